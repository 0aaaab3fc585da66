"""n > 1 in the engine: one prefill, n choices. The choices sample their first tokens from
the prompt's one logits row (choice i of a seeded request with a generator seeded seed + i),
then fork: the prompt's full blocks are shared by reference count, a partial last block is
copied. Colocated (one engine) and disaggregated (a prefill-only engine hands the first
tokens and generator states to a decode engine with one KV copy) give the same streams."""
from __future__ import annotations

import pytest

from pdserve.common.engine.engine import LLMEngine
from pdserve.common.engine.sequence import SequenceStatus
from pdserve.common.sampling_params import SamplingParams
from tests.support.engines import BLOCK, check_baseline, config, prompt


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


def run(engine: LLMEngine, ids: list[int], params: SamplingParams) -> list[list[int]]:
    """Every choice's output of one request computed by `engine` alone."""
    seq = engine.add_request(ids, params)
    choices = [seq, *seq.forks]
    while engine.has_work():
        engine.step()
    assert all(c.status == SequenceStatus.FINISHED for c in choices)
    return [c.output_token_ids for c in choices]


def disaggregated(p: LLMEngine, d: LLMEngine, ids: list[int], params: SamplingParams) -> tuple[list[list[int]], int]:
    """Every choice's output with the prompt prefilled on `p` and its KV copied once into
    `d`'s reserved blocks; returns the outputs and the number of blocks copied."""
    seq_d = d.new_sequence(ids, params)
    dst = d.reserve(seq_d)
    assert dst is not None
    choices = [seq_d, *seq_d.forks]
    seq_p = p.new_sequence(ids, params)
    p.add(seq_p)
    (out,) = p.step()
    assert len(out.forks) == params.n - 1
    d.runner.kv_cache[:, :, dst] = p.runner.kv_cache[:, :, seq_p.block_table[len(seq_p.block_table) - len(dst):]]
    forks = [(f.new_token, p.sampler_state(f.seq), f.logprobs) for f in out.forks]
    outs = d.start_decoding(seq_d, out.new_token, p.sampler_state(seq_p), out.logprobs, forks)
    assert [o.seq.index for o in outs] == list(range(params.n))
    p.release(seq_p, "prefilled")
    while d.has_work():
        d.step()
    return [c.output_token_ids for c in choices], len(dst)


@pytest.mark.parametrize("length", [35, 32])  # a partial last block (copied), and none
def test_greedy_choices_are_identical_and_equal_transformers(model_dir, hf_greedy, torch_one_thread, length):
    engine = LLMEngine(config(model_dir))
    ids = prompt(length, 1)
    outs = run(engine, ids, SamplingParams(n=3, temperature=0.0, max_tokens=10, ignore_eos=True))
    assert outs == [hf_greedy(model_dir, ids, 10)] * 3
    check_baseline(engine)


def test_prompt_is_computed_once_and_its_blocks_shared(model_dir, torch_one_thread):
    """After the prefill step: the full blocks are held by every choice (ref count n), the
    partial block was copied into one new block per fork, and only the prompt's tokens
    were computed."""
    engine = LLMEngine(config(model_dir))
    ids = prompt(35, 2)  # 2 full blocks + 3 tokens
    seq = engine.add_request(ids, SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))
    forks = list(seq.forks)
    batch_tokens = []
    schedule = engine.scheduler.schedule

    def counted():
        batch = schedule()
        batch_tokens.append(batch.total_tokens)
        return batch
    engine.scheduler.schedule = counted
    outs = engine.step()
    assert batch_tokens == [len(ids)] and len(outs) == 4 and not seq.forks
    bm = engine.block_manager
    for b in seq.block_table[:2]:
        assert bm.blocks[b].ref_count == 4
    tails = [c.block_table[2] for c in [seq, *forks]]
    assert len(set(tails)) == 4 and all(bm.blocks[b].ref_count == 1 for b in tails)
    assert all(c.block_table[:2] == seq.block_table[:2] for c in forks)
    kv = engine.runner.kv_cache
    for t in tails[1:]:
        assert kv[:, :, t, :3].equal(kv[:, :, tails[0], :3])  # the copied tokens' KV
    assert bm.num_free_blocks == bm.num_blocks - 2 - 4
    while engine.has_work():
        engine.step()
    assert sum(batch_tokens) == len(ids) + 4 * 4  # then one token per choice per step
    check_baseline(engine)


def test_seeded_choices_are_reproducible_and_differ(model_dir, torch_one_thread):
    ids = prompt(40, 3)
    params = SamplingParams(n=4, temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    first = run(LLMEngine(config(model_dir)), ids, params)
    assert first == run(LLMEngine(config(model_dir, seed=5)), ids, params)  # the engine's own seed plays no part
    assert len({tuple(o) for o in first}) == 4
    # choice i draws from seed + i: choice 0 is the n = 1 request's stream, choice 2 that of seed 13
    engine = LLMEngine(config(model_dir))
    assert run(engine, ids, SamplingParams(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)) == [first[0]]
    assert run(engine, ids, SamplingParams(temperature=1.0, seed=13, max_tokens=12, ignore_eos=True)) == [first[2]]


@pytest.mark.parametrize("length", [40, 48])
def test_disaggregated_choices_equal_one_engine_with_the_kv_sent_once(model_dir, torch_one_thread, length):
    ids = prompt(length, 4)
    params = SamplingParams(n=4, temperature=1.0, seed=-7, max_tokens=12, ignore_eos=True, logprobs=2)
    want = run(LLMEngine(config(model_dir)), ids, params)
    p = LLMEngine(config(model_dir), prefill_only=True)
    d = LLMEngine(config(model_dir, seed=99))
    got, copied = disaggregated(p, d, ids, params)
    assert got == want
    assert copied == -(-length // BLOCK)  # the prompt's blocks, once, for all four choices
    check_baseline(p, d)


def test_abort_releases_every_choice(model_dir, torch_one_thread):
    engine = LLMEngine(config(model_dir))
    waiting = engine.add_request(prompt(30, 5), SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    engine.abort(waiting)  # before its prefill: the forks hold nothing yet
    check_baseline(engine)
    seq = engine.add_request(prompt(30, 5), SamplingParams(n=3, max_tokens=20, ignore_eos=True))
    choices = [seq, *seq.forks]
    engine.step()
    engine.step()
    for c in choices:
        engine.abort(c)
    check_baseline(engine)


def test_a_fork_without_a_free_block_is_recomputed(model_dir, hf_greedy, torch_one_thread):
    """A cache too small to copy every fork's partial block: the forks that find none wait
    and are computed again from the prefix cache; the output is the same."""
    ids = prompt(100, 6)  # 6 full blocks and a partial one: one block is left for the copies
    engine = LLMEngine(config(model_dir, num_kv_blocks=8, max_num_seqs=4))
    outs = run(engine, ids, SamplingParams(n=4, temperature=0.0, max_tokens=6, ignore_eos=True))
    assert outs == [hf_greedy(model_dir, ids, 6)] * 4
    assert engine.scheduler.num_preemptions > 0
    check_baseline(engine)


def test_the_choices_count_against_max_num_seqs(model_dir, torch_one_thread):
    engine = LLMEngine(config(model_dir, max_num_seqs=4))
    a = engine.add_request(prompt(20, 7), SamplingParams(n=3, max_tokens=4, ignore_eos=True))
    b = engine.add_request(prompt(20, 8), SamplingParams(n=2, max_tokens=4, ignore_eos=True))
    engine.step()
    assert a.status == SequenceStatus.RUNNING and b.status == SequenceStatus.WAITING  # 3 + 2 > 4
    big = LLMEngine(config(model_dir, max_num_seqs=2))
    assert len(run(big, prompt(20, 9), SamplingParams(n=5, max_tokens=3, ignore_eos=True))) == 5  # alone, it runs
    check_baseline(big)
