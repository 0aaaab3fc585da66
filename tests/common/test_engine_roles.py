"""The engine's two disaggregated roles in one process: a prefill-only engine P pushes
each finished KV block, layer by layer during its forward, into the blocks a decode
engine D reserved (D's own prefix-cached blocks are skipped); D starts decoding from P's
first token and sampler state. The result is what one engine would have produced."""
from __future__ import annotations


import pytest

from pdserve.common.engine.engine import KVProgress, LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from tests.support.engines import BLOCK, MAX_LEN, check_baseline, config, prompt  # noqa: F401


class BlockPush:
    """P's KVWriter: copies blocks [pushed, complete) of each scheduled sequence into D's
    cache at the reserved ids, one layer at a time as the forward writes it."""

    def __init__(self, p: LLMEngine, d: LLMEngine) -> None:
        self.p, self.d = p, d
        self.jobs: dict[int, tuple[Sequence, list[int], int]] = {}  # P seq id -> (D seq, dst, skip)
        self.pushed: dict[int, int] = {}
        self.copies: list[tuple[list[int], list[int]]] = []
        self.advanced: list[tuple[int, int]] = []
        self.writes: dict[tuple[int, int, int], int] = {}  # (D seq id, layer, dst block) -> times written

    def add(self, seq_p: Sequence, seq_d: Sequence, dst: list[int]) -> None:
        skip = len(seq_d.block_table) - len(dst)
        self.jobs[seq_p.seq_id] = (seq_d, dst, skip)
        self.pushed[seq_p.seq_id] = skip

    def plan(self, progress: list[KVProgress]) -> bool:
        self.copies, self.advanced = [], []
        for pr in progress:
            seq_d, dst, skip = self.jobs[pr.seq.seq_id]
            lo, hi = self.pushed[pr.seq.seq_id], pr.complete_blocks
            assert hi <= len(pr.seq.block_table)
            if hi > lo:
                self.copies.append((pr.seq.block_table[lo:hi], dst[lo - skip:hi - skip]))
                self.advanced.append((pr.seq.seq_id, hi))
                for layer in range(self.p.config.model.num_layers):
                    for b in dst[lo - skip:hi - skip]:
                        key = (seq_d.seq_id, layer, b)
                        self.writes[key] = self.writes.get(key, 0) + 1
        return bool(self.copies)

    def write_layer(self, layer: int) -> None:
        src_cache, dst_cache = self.p.runner.kv_cache, self.d.runner.kv_cache
        for src, dst in self.copies:
            dst_cache[:, layer, dst] = src_cache[:, layer, src]

    def commit(self) -> None:
        for seq_id, hi in self.advanced:
            self.pushed[seq_id] = hi
        self.copies, self.advanced = [], []


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


def disaggregate(p: LLMEngine, d: LLMEngine, waves: list[list[list[int]]], params: SamplingParams
                 ) -> tuple[list[Sequence], BlockPush, list[int]]:
    """Serve each wave of prompts through P then D; a wave is reserved once the previous
    one has started decoding (so D's prefix cache can serve it). D decodes between P's
    steps. Returns D's sequences, the writer, and how many blocks each reservation skipped."""
    push = BlockPush(p, d)
    done: list[Sequence] = []
    skips: list[int] = []
    for wave in waves:
        pairs: dict[int, tuple[Sequence, Sequence]] = {}
        for ids in wave:
            seq_d = d.new_sequence(ids, params)
            dst = d.reserve(seq_d)
            assert dst is not None, "the test sizes D to hold a whole wave"
            assert seq_d.status == SequenceStatus.RESERVED and seq_d.block_table[-len(dst):] == dst
            assert len(seq_d.block_table) == -(-len(ids) // BLOCK)
            skips.append(len(seq_d.block_table) - len(dst))
            seq_p = p.new_sequence(ids, params)
            p.add(seq_p)
            push.add(seq_p, seq_d, dst)
            pairs[seq_p.seq_id] = (seq_p, seq_d)
            done.append(seq_d)
        while p.has_work():
            outs = p.step(push)
            push.commit()
            for out in outs:
                assert out.finished and out.seq.status == SequenceStatus.PREFILLED
                seq_p, seq_d = pairs.pop(out.seq.seq_id)
                assert push.pushed[seq_p.seq_id] == len(seq_p.block_table), "every block pushed by the end"
                d.start_decoding(seq_d, out.new_token, p.sampler_state(seq_p))
                p.release(seq_p, "prefilled")
            if d.has_work():
                d.step()
        assert not pairs
    while d.has_work():
        d.step()
    return done, push, skips


def test_greedy_handoff_matches_transformers(model_dir, hf_greedy, torch_one_thread):
    # P's 32-token budget chunks the longer prompts; D holds every wave at once
    p = LLMEngine(config(model_dir, max_num_batched_tokens=32), prefill_only=True)
    d = LLMEngine(config(model_dir, num_kv_blocks=64))
    base = prompt(50, 1)
    wave1 = [prompt(n, 10 + n) for n in (1, 15, 16, 17, 33)] + [base + prompt(50, 2)]
    wave2 = [base + prompt(7, 3), base[:32] + prompt(30, 4), base[:48]]  # D's cache serves their prefixes
    params = SamplingParams(temperature=0.0, max_tokens=12)
    seqs, push, skips = disaggregate(p, d, [wave1, wave2], params)
    assert skips[:len(wave1)] == [0] * len(wave1)
    assert skips[len(wave1):] == [3, 2, 2]  # full cached blocks; a prompt's last token is always computed
    for i, (seq, ids) in enumerate(zip(seqs, wave1 + wave2)):
        assert seq.status == SequenceStatus.FINISHED
        assert seq.output_token_ids == hf_greedy(model_dir, ids, 12), f"prompt {i} (len {len(ids)})"
    assert set(push.writes.values()) == {1}, "each (layer, block) written once"
    n_written = len(push.writes) // p.config.model.num_layers
    assert n_written == sum(-(-len(ids) // BLOCK) for ids in wave1 + wave2) - sum(skips)
    check_baseline(p, d)


def test_seeded_random_handoff_matches_one_engine(model_dir, torch_one_thread):
    """temperature 1 with a seed: P's generator state after the first draw goes to D."""
    ids = [prompt(40, 5), prompt(70, 6), prompt(9, 7)]
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=15, ignore_eos=True)
    offline = LLMEngine(config(model_dir, num_kv_blocks=64))
    ref = [offline.add_request(x, params) for x in ids]
    while offline.has_work():
        offline.step()
    p = LLMEngine(config(model_dir, max_num_batched_tokens=32), prefill_only=True)
    d = LLMEngine(config(model_dir, num_kv_blocks=64, seed=99))  # its engine-wide generator is not used
    seqs, _, _ = disaggregate(p, d, [ids], params)
    for r, s in zip(ref, seqs):
        assert len(s.output_token_ids) == 15
        assert s.output_token_ids == r.output_token_ids
    # without the state D would redraw the first token's randomness: the streams differ
    p2 = LLMEngine(config(model_dir), prefill_only=True)
    d2 = LLMEngine(config(model_dir, num_kv_blocks=64))
    seq_p = p2.new_sequence(ids[0], params)
    p2.add(seq_p)
    (out,) = p2.step()
    seq_d = d2.new_sequence(ids[0], params)
    d2.reserve(seq_d)
    d2.runner.kv_cache[:, :, seq_d.block_table] = p2.runner.kv_cache[:, :, seq_p.block_table]
    d2.start_decoding(seq_d, out.new_token)  # no sampler state
    p2.release(seq_p)
    while d2.has_work():
        d2.step()
    assert seq_d.output_token_ids[0] == ref[0].output_token_ids[0]
    assert seq_d.output_token_ids != ref[0].output_token_ids
    check_baseline(offline, p, d, p2, d2)


def test_prefill_only_engine_holds_blocks_until_release(model_dir, torch_one_thread):
    p = LLMEngine(config(model_dir, max_num_batched_tokens=32), prefill_only=True)
    seq = p.new_sequence(prompt(40, 8), SamplingParams(temperature=0.0, max_tokens=5))
    p.add(seq)
    assert p.step() == []  # 32 + 8 tokens: no token after the first chunk
    other = p.new_sequence(prompt(5, 9), SamplingParams(temperature=0.0))
    p.add(other)
    outs = p.step()  # the last 8 tokens and the whole short prompt
    assert {o.seq.seq_id for o in outs} == {seq.seq_id, other.seq_id}
    assert all(o.finished and o.seq.status == SequenceStatus.PREFILLED for o in outs)
    assert not p.has_work() and p.block_manager.num_free_blocks == 32 - 3 - 1
    for o in outs:
        assert len(o.seq.output_token_ids) == 1
        p.release(o.seq, "prefilled")
    check_baseline(p)


def test_prefill_only_engine_progress_reports(model_dir, torch_one_thread):
    """complete_blocks counts full blocks after each chunk, and the partial last block
    once the prompt completes."""
    p = LLMEngine(config(model_dir, max_num_batched_tokens=24), prefill_only=True)
    seen: list[int] = []

    class Spy:
        def plan(self, progress):
            seen.extend(pr.complete_blocks for pr in progress)
            return False

        def write_layer(self, layer):
            raise AssertionError("plan said no")

    seq = p.new_sequence(prompt(70, 11), SamplingParams(temperature=0.0))
    p.add(seq)
    while p.has_work():
        p.step(Spy())
    assert seen == [1, 3, 5]  # after 24 and 48 tokens: 1 and 3 full blocks; at 70 (done): all 5
    p.release(seq)
    check_baseline(p)


def test_reserve_counts_reserved_and_running_against_max_num_seqs(model_dir, torch_one_thread):
    d = LLMEngine(config(model_dir, max_num_seqs=2))
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    a, b, c = (d.new_sequence(prompt(20, 20 + i), params) for i in range(3))
    assert d.reserve(a) is not None and d.reserve(b) is not None
    free = d.block_manager.num_free_blocks
    assert d.reserve(c) is None
    assert c.status == SequenceStatus.WAITING and c.block_table == [] and d.block_manager.num_free_blocks == free
    local = d.add_request(prompt(10, 30), params)  # queued: no batch slot while two are reserved
    assert d.step() == [] and local.status == SequenceStatus.WAITING
    d.start_decoding(a, 5)  # running + reserved is still 2
    assert d.reserve(c) is None
    d.release(b)  # a reservation given up (its prefill failed)
    assert b.status == SequenceStatus.FINISHED and b.block_table == []
    assert d.reserve(c) is not None  # the slot b left
    assert d.step() and local.status == SequenceStatus.WAITING  # a decodes; still no slot for local
    d.release(c)
    while d.has_work():
        d.step()
    assert a.status == local.status == SequenceStatus.FINISHED
    check_baseline(d)


def test_reserve_returns_none_when_blocks_are_short(model_dir, torch_one_thread):
    d = LLMEngine(config(model_dir, num_kv_blocks=8))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    big = d.new_sequence(prompt(100, 40), params)
    small = d.new_sequence(prompt(20, 41), params)
    assert len(d.reserve(big)) == 7
    assert d.block_manager.num_free_blocks == 1
    assert d.reserve(small) is None  # needs 2
    assert small.block_table == [] and small.status == SequenceStatus.WAITING
    assert d.block_manager.num_free_blocks == 1
    d.block_manager.check_invariants()
    tiny = d.new_sequence(prompt(16, 42), params)
    assert len(d.reserve(tiny)) == 1  # exactly one block fits
    d.release(tiny)
    d.release(big)
    assert d.reserve(small) is not None
    d.release(small)
    check_baseline(d)


def test_start_decoding_first_token_can_finish(model_dir, torch_one_thread):
    d = LLMEngine(config(model_dir))
    seq = d.new_sequence(prompt(20, 50), SamplingParams(temperature=0.0, max_tokens=1))
    d.reserve(seq)
    out, = d.start_decoding(seq, 42)
    assert out.finished and seq.status == SequenceStatus.FINISHED and seq.finish_reason == "length"
    assert seq.output_token_ids == [42]
    eos = d.new_sequence(prompt(20, 51), SamplingParams(temperature=0.0, max_tokens=5))
    d.reserve(eos)
    out, = d.start_decoding(eos, min(d.eos_token_ids))
    assert out.finished and eos.finish_reason == "stop"
    check_baseline(d)


def test_reserved_blocks_enter_the_prefix_cache_only_once_filled(model_dir, torch_one_thread):
    """A reservation that never got its KV must not serve a later prompt's prefix."""
    d = LLMEngine(config(model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    ids = prompt(50, 60)
    first = d.new_sequence(ids, params)
    d.reserve(first)
    second = d.new_sequence(ids, params)
    assert len(d.reserve(second)) == 4  # nothing cached yet: all four blocks must come from P
    d.release(first)  # aborted before its KV came
    third = d.new_sequence(ids, params)
    assert len(d.reserve(third)) == 4
    d.start_decoding(second, 7)
    fourth = d.new_sequence(ids, params)
    assert len(d.reserve(fourth)) == 1  # now the three full blocks are cached
    for s in (second, third, fourth):
        d.release(s)
    check_baseline(d)


def test_a_warmed_up_engine_is_as_it_started_and_serves_the_same(model_dir, hf_greedy, torch_one_thread):
    """warm_up (what every worker runs before its hello): every block free, nothing in the
    prefix cache nor in its events for the router, nothing queued; both roles then serve
    transformers' greedy output, and a prefill-only one hands off as before."""
    p = LLMEngine(config(model_dir, max_num_batched_tokens=32), prefill_only=True, warm_up=True)
    d = LLMEngine(config(model_dir, num_kv_blocks=64), warm_up=True)
    for e in (p, d):
        assert e.warm_up_s is not None and e.warm_up_s > 0
        check_baseline(e)
        assert not e.block_manager._hash_to_block and e.block_manager.take_events() == []
    assert LLMEngine(config(model_dir)).warm_up_s is None  # the offline engine does not warm up
    ids = [prompt(40, 21), prompt(9, 22), [0] * 8]  # the last one is the warm-up's own prompt
    params = SamplingParams(temperature=0.0, max_tokens=8)
    seqs, _, skips = disaggregate(p, d, [ids], params)
    assert skips == [0, 0, 0]
    for seq, one in zip(seqs, ids):
        assert seq.output_token_ids == hf_greedy(model_dir, one, 8)
    check_baseline(p, d)
