"""The prefill worker's job state machine, driven in-process: a recorder for its server
socket and fake senders (layer by layer, or all at hand-off) that copy P's blocks into a
stand-in for D's cache, so what reached D can be compared with P's own cache."""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from pdserve.common.wire.auth import new_secret
from pdserve.common.config import EngineConfig, WorkerConfig
from pdserve.common.wire.messages import AbortRequest, ErrorReply, KVReady, PrefillFailed, PrefillRequest
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.transport import Incoming
from pdserve.kv_transfer import KVSender
from pdserve.prefill_node.jobs import TERMINAL, TRANSITIONS, JobState, JobTable, PrefillJob
from pdserve.prefill_node.worker import PrefillWorker

BLOCK = 16
NUM_BLOCKS = 32
MAX_LEN = 128
BUDGET = 32  # a 100-token prompt takes four steps
D_ID = "d0"
D_IDENTITY = b"d0"


class Recorder:
    address = "tcp://127.0.0.1:0"

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object, list]] = []

    def send(self, identity: bytes, msg: object, frames=()) -> None:
        self.sent.append((identity, msg, list(frames)))

    def close(self) -> None:
        pass

    def replies(self, request_id: str) -> list[object]:
        return [m for _, m, _ in self.sent if getattr(m, "request_id", None) == request_id]


class FakeSender(KVSender):
    """Copies P's blocks into `d_cache` (D's cache stand-in) and records every call."""

    backend = "fake"

    def __init__(self, kv_cache: torch.Tensor, d_blocks: int, layerwise: bool) -> None:
        super().__init__(kv_cache, {})
        self.layerwise = layerwise
        self.d_cache = torch.full((kv_cache.shape[0], kv_cache.shape[1], d_blocks, *kv_cache.shape[3:]),
                                  float("nan"), dtype=kv_cache.dtype)
        self.layer_writes: list[tuple[int, list[int], list[int]]] = []
        self.sends: list[tuple[str, list[int], list[int]]] = []
        self.closed = False

    def write_layer(self, layer: int, src: list[int], dst: list[int]) -> None:
        assert self.layerwise
        self.layer_writes.append((layer, list(src), list(dst)))
        self.d_cache[:, layer, dst] = self.kv_cache[:, layer, src]

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        assert not self.layerwise
        self.sends.append((ready.request_id, list(src), list(dst)))
        self.d_cache[:, :, dst] = self.kv_cache[:, :, src]
        return []

    def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="module")
def prefill_config(model_dirs) -> EngineConfig:
    return EngineConfig.build(model_dirs["qwen3"], block_size=BLOCK, num_kv_blocks=NUM_BLOCKS, max_model_len=MAX_LEN,
                              max_num_batched_tokens=BUDGET, num_threads=1)


class Harness:
    def __init__(self, config: EngineConfig, layerwise: bool) -> None:
        self.worker = PrefillWorker(config, WorkerConfig(role="prefill", worker_id="p0", kv_transfer="tcp", secret=new_secret()))
        self.worker.server.close()
        self.server = self.worker.server = Recorder()
        self.sender = FakeSender(self.worker.engine.runner.kv_cache, 64, layerwise)
        self.worker.senders[D_ID] = self.sender
        self.worker.peer_blocks[D_ID] = 64  # what D's handshake advertised
        self.baseline = self.worker.engine.block_manager.num_free_blocks
        self.next_dst = 0
        self.final_blocks: dict[str, list[int]] = {}  # P's block table of each job when it ended
        self.final_kv: dict[str, torch.Tensor] = {}  # and its KV at the end of the prefill
        hand_off, end = self.worker.hand_off, self.worker.end

        def recording_hand_off(job, out, prefill_end):
            self.final_blocks[job.request_id] = list(job.seq.block_table)
            self.final_kv[job.request_id] = self.worker.engine.runner.kv_cache[:, :, job.seq.block_table].clone()
            hand_off(job, out, prefill_end)

        def recording_end(job, state, reason):
            self.final_blocks[job.request_id] = list(job.seq.block_table)
            end(job, state, reason)

        self.worker.hand_off = recording_hand_off
        self.worker.end = recording_end

    def prefill(self, rid: str, prompt: list[int], skip: int = 0, dst: list[int] | None = None,
                decode_id: str = D_ID, **sp) -> list[int]:
        if dst is None:
            n = -(-len(prompt) // BLOCK) - skip
            dst = list(range(self.next_dst, self.next_dst + n))
            self.next_dst += n
        params = SamplingParams(temperature=sp.pop("temperature", 0.0), max_tokens=sp.pop("max_tokens", 8), **sp)
        self.worker.on_prefill(D_IDENTITY, PrefillRequest(rid, decode_id, prompt, params, skip, dst))
        return dst

    def abort(self, rid: str) -> None:
        self.worker.handle(Incoming(D_IDENTITY, AbortRequest(rid), []))

    def job(self, rid: str) -> PrefillJob | None:
        jobs = self.worker.jobs.find_request(rid)
        assert len(jobs) <= 1
        return jobs[0] if jobs else None

    def state(self, rid: str) -> JobState | None:
        job = self.job(rid)
        return None if job is None else job.state

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.worker.has_work():
                return
            self.worker.step()
        raise AssertionError("no progress")

    def terminal(self, rid: str) -> object:
        replies = self.server.replies(rid)
        assert len(replies) == 1, f"{rid}: {replies}"
        assert isinstance(replies[0], (KVReady, PrefillFailed))
        return replies[0]

    def check_clean(self) -> None:
        bm = self.worker.engine.block_manager
        bm.check_invariants()
        assert len(self.worker.jobs) == 0
        assert bm.num_free_blocks == bm.num_blocks == self.baseline
        s = self.worker.engine.scheduler
        assert not s.waiting and not s.running
        assert all(i == D_IDENTITY for i, _, _ in self.server.sent)


@pytest.fixture(params=[True, False], ids=["layerwise", "at_handoff"])
def h(request, prefill_config):
    harness = Harness(prefill_config, request.param)
    try:
        yield harness
        harness.check_clean()
    finally:
        harness.worker.close()
    assert harness.sender.closed


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def check_pushed(h: Harness, rid: str, dst: list[int], skip: int = 0) -> None:
    """Every dst block got P's final KV of the matching src block, written once per layer."""
    src = h.final_blocks[rid][skip:]
    assert len(src) == len(dst)
    s = h.sender
    if s.layerwise:
        writes = Counter((layer, d) for layer, _, ds in s.layer_writes for d in ds if d in dst)
        layers = h.worker.engine.config.model.num_layers
        assert writes == Counter({(layer, d): 1 for layer in range(layers) for d in dst}), "each (layer, block) once"
        pairs = {(d, sr) for _, srcs, ds in s.layer_writes for sr, d in zip(srcs, ds) if d in dst}
        assert pairs == set(zip(dst, src)), "the right P block went to each D block"
    else:
        assert [x for x in s.sends if x[0] == rid] == [(rid, src, dst)]
    torch.testing.assert_close(s.d_cache[:, :, dst], h.final_kv[rid][:, :, skip:], rtol=0, atol=0)


# ---- the table alone ----------------------------------------------------------------------

def test_table_transitions():
    from pdserve.common.engine.sequence import Sequence
    for src in JobState:
        for dst in JobState:
            table = JobTable()
            job = PrefillJob("r", Sequence(1, [5], SamplingParams()), b"d", D_ID, 0, [0])
            table.add(job)
            job.state = src
            if dst in TRANSITIONS.get(src, frozenset()):
                table.move(job, dst)
                assert (len(table) == 0) == (dst in TERMINAL)
                assert (table.by_seq(1) is None) == (dst in TERMINAL)
            else:
                with pytest.raises(RuntimeError):
                    table.move(job, dst)
                assert job.state == src and table.by_seq(1) is job


# ---- scenarios --------------------------------------------------------------------------------

def test_chunked_prefill_queued_prefilling_sent(h, model_dirs, hf_greedy):
    p = prompt(100, 1)  # 7 blocks, 4 steps of 32 tokens
    dst = h.prefill("a", p)
    assert h.state("a") == JobState.QUEUED and h.server.sent == []
    states = []
    for _ in range(3):
        h.worker.step()
        states.append(h.state("a"))
        if h.sender.layerwise:  # blocks finished so far are in D already
            done = h.job("a").pushed
            assert done == h.job("a").seq.num_computed_tokens // BLOCK
            assert {d for _, _, ds in h.sender.layer_writes for d in ds} == set(dst[:done])
        else:
            assert h.sender.sends == []
    assert states == [JobState.PREFILLING] * 3 and h.server.sent == []
    h.worker.step()
    assert h.state("a") is None
    ready = h.terminal("a")
    assert isinstance(ready, KVReady) and ready.num_blocks == len(dst) == 7
    assert ready.first_token == hf_greedy(model_dirs["qwen3"], p, 1)[0]
    assert ready.sampler_state == b""  # greedy: no generator
    check_pushed(h, "a", dst)
    assert h.worker.counters["prefills"] == 1 and h.worker.counters["blocks_sent"] == 7


@pytest.mark.parametrize("n", [1, 16, 17, 32, 50])
def test_prompt_lengths_across_block_boundaries(h, n, model_dirs, hf_greedy):
    p = prompt(n, 100 + n)
    dst = h.prefill("a", p)
    h.run()
    ready = h.terminal("a")
    assert ready.first_token == hf_greedy(model_dirs["qwen3"], p, 1)[0]
    check_pushed(h, "a", dst)


@pytest.mark.parametrize("skip_b", [0, 2])
def test_shared_prefix_and_skipped_blocks(h, model_dirs, hf_greedy, skip_b):
    """Two jobs sharing a prefix (P's prefix cache serves the second); the second skips
    the blocks D already holds, if any: P's cached blocks D lacks still travel."""
    base = prompt(40, 2)
    pa, pb = base + prompt(5, 3), base + prompt(20, 4)
    dst_a = h.prefill("a", pa)
    dst_b = h.prefill("b", pb, skip=skip_b)
    assert len(dst_b) == 4 - skip_b
    h.run()
    assert h.worker.counters["prefix_hit_tokens"] == 32
    for rid, p, dst in (("a", pa, dst_a), ("b", pb, dst_b)):
        ready = h.terminal(rid)
        assert ready.first_token == hf_greedy(model_dirs["qwen3"], p, 1)[0]
        check_pushed(h, rid, dst, skip=skip_b if rid == "b" else 0)
    assert h.final_blocks["b"][:2] == h.final_blocks["a"][:2]  # P's prefix cache served b


def test_seeded_request_carries_its_sampler_state(h):
    h.prefill("a", prompt(30, 5), temperature=1.0, seed=123)
    h.run()
    ready = h.terminal("a")
    assert ready.sampler_state != b""
    assert not h.worker.engine.runner._generators, "the generator is released with the job"


def test_abort_queued(h):
    h.prefill("a", prompt(100, 6))
    h.prefill("b", prompt(20, 7))
    h.abort("b")
    assert h.state("b") is None and h.state("a") == JobState.QUEUED
    failed = h.terminal("b")
    assert isinstance(failed, PrefillFailed)
    h.run()
    assert isinstance(h.terminal("a"), KVReady)


def test_abort_prefilling(h):
    dst = h.prefill("a", prompt(100, 8))
    h.worker.step()
    h.worker.step()
    assert h.state("a") == JobState.PREFILLING
    assert h.worker.engine.block_manager.num_free_blocks < h.baseline
    h.abort("a")
    assert h.state("a") is None and h.worker.engine.block_manager.num_free_blocks == h.baseline
    assert isinstance(h.terminal("a"), PrefillFailed)
    assert not h.worker.has_work()
    h.abort("a")  # a late abort for a finished job changes nothing; it is answered, which fences D's lease
    h.abort("nobody")
    late = h.server.replies("a")
    assert len(late) == 2 and all(isinstance(r, PrefillFailed) for r in late)
    assert h.worker.engine.block_manager.num_free_blocks == h.baseline
    if h.sender.layerwise:
        assert {d for _, _, ds in h.sender.layer_writes for d in ds} <= set(dst)
    else:
        assert h.sender.sends == []


def test_abort_after_sent_changes_nothing(h):
    """The job is done: the abort is answered (D's lease waits on an answer to fence P),
    after the KVReady, which D has already acted on."""
    h.prefill("a", prompt(10, 9))
    h.run()
    h.abort("a")
    replies = h.server.replies("a")
    assert [type(r) for r in replies] == [KVReady, PrefillFailed]
    assert h.worker.engine.block_manager.num_free_blocks == h.baseline


@pytest.mark.parametrize("case", ["unknown_decode", "too_few_dst", "too_many_dst", "skip_all", "negative_skip",
                                  "bad_token", "empty_prompt", "too_long", "bad_sampling"])
def test_refused_prefill_request(h, case):
    p = prompt(40, 10)  # 3 blocks
    kwargs: dict = {}
    if case == "unknown_decode":
        kwargs = dict(decode_id="d9")
    elif case == "too_few_dst":
        kwargs = dict(dst=[0, 1])
    elif case == "too_many_dst":
        kwargs = dict(dst=[0, 1, 2, 3])
    elif case == "skip_all":
        kwargs = dict(skip=3, dst=[])
    elif case == "negative_skip":
        kwargs = dict(skip=-1, dst=[0, 1, 2, 3])
    elif case == "bad_token":
        p = [5, 10**6]
    elif case == "empty_prompt":
        p = []
    elif case == "too_long":
        p = prompt(MAX_LEN, 11)
    if case == "bad_sampling":
        bad = SamplingParams.unchecked(temperature=-1.0, max_tokens=4)
        h.worker.on_prefill(D_IDENTITY, PrefillRequest("a", D_ID, p, bad, 0, [0, 1, 2]))
    else:
        if case in ("empty_prompt", "bad_token", "too_long"):
            kwargs = dict(dst=[0, 1])
        h.prefill("a", p, **kwargs)
    assert h.state("a") is None and len(h.worker.jobs) == 0 and not h.worker.has_work()
    failed = h.terminal("a")
    assert isinstance(failed, PrefillFailed) and failed.message
    if case == "unknown_decode":
        assert "d9" in failed.message


def test_mixed_run_leaves_nothing_behind(h, model_dirs, hf_greedy):
    """Random arrivals and aborts among steps; every job ends with exactly one reply."""
    rng = random.Random(3)
    prompts = {}
    for i in range(12):
        rid = f"q{i}"
        prompts[rid] = prompt(rng.randrange(1, 110), 200 + i)
        h.prefill(rid, prompts[rid])
        for _ in range(rng.randrange(0, 3)):
            if h.worker.has_work():
                h.worker.step()
        if rng.random() < 0.3:
            live = [j.request_id for j in list(h.worker.jobs._by_seq.values())]
            if live:
                h.abort(rng.choice(live))
    h.run()
    for rid, p in prompts.items():
        reply = h.terminal(rid)
        if isinstance(reply, KVReady):
            assert reply.first_token == hf_greedy(model_dirs["qwen3"], p, 1)[0]


def test_handle_refuses_other_messages(h):
    from pdserve.common.wire.messages import GenerateRequest
    h.worker.handle(Incoming(D_IDENTITY, GenerateRequest("g", [5], SamplingParams()), []))
    assert isinstance(h.server.sent[-1][1], ErrorReply)
    h.server.sent.clear()


def test_failed_send_fails_only_its_job(h, monkeypatch, model_dirs, hf_greedy):
    """A KV send that raises (e.g. a broken process group) fails that job; the worker goes on."""
    if h.sender.layerwise:
        monkeypatch.setattr(h.sender, "write_layer", lambda *a: None)  # data went layer by layer; send is a no-op
    boom = {"b"}
    send = h.sender.send

    def flaky_send(ready, src, dst):
        if ready.request_id in boom:
            raise RuntimeError("connection reset by peer")
        return send(ready, src, dst)

    monkeypatch.setattr(h.sender, "send", flaky_send)
    monkeypatch.setattr(h.sender, "layerwise", False)
    good = prompt(20, 30)
    h.prefill("a", good)
    h.prefill("b", prompt(20, 31))
    h.run()
    failed = h.terminal("b")
    assert isinstance(failed, PrefillFailed) and "connection reset" in failed.message
    ready = h.terminal("a")
    assert isinstance(ready, KVReady) and ready.first_token == hf_greedy(model_dirs["qwen3"], good, 1)[0]


@pytest.mark.parametrize("layerwise", [True, False])
def test_a_scored_prompt_sends_no_kv(prefill_config, layerwise):
    """max_tokens 0 with prompt_logprobs: P computes the 100-token prompt in four steps,
    writes nothing into D's blocks, and answers KVReady(first_token -1) with one logprob
    per prompt token; it holds no block afterwards."""
    h = Harness(prefill_config, layerwise)
    prompt = [random.Random(9).randrange(1, 200) for _ in range(100)]
    h.prefill("scored", prompt, max_tokens=0, prompt_logprobs=1)
    h.run()
    ready = h.terminal("scored")
    assert isinstance(ready, KVReady) and ready.first_token == -1 and ready.num_blocks == 0
    assert len(ready.prompt_logprobs) == 100 and ready.prompt_logprobs[0] is None
    assert all(lp is not None and len(lp.top_ids) == 1 for lp in ready.prompt_logprobs[1:])
    assert h.sender.layer_writes == [] and h.sender.sends == []
    assert h.state("scored") is None and h.worker.engine.block_manager.num_free_blocks == h.baseline
