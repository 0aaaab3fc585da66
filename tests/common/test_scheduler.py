"""Scheduler policy without a model: the token budget, chunked prefill, the sequence
limit, FCFS admission and preemption by recompute. A step is simulated by schedule(),
advance(), and a fake sampled token for every seq that became ready."""
from __future__ import annotations

import random

import hypothesis.strategies as st
from hypothesis import given, settings

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.config import SchedulerConfig
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.common.engine.sequence import Sequence, SequenceStatus

FAKE_TOKEN = 1


def _make(num_blocks: int, block_size: int = 4, **cfg) -> tuple[BlockManager, Scheduler]:
    bm = BlockManager(num_blocks, block_size)
    return bm, Scheduler(SchedulerConfig(**cfg), bm)


def _seq(seq_id: int, prompt_len: int, max_tokens: int, base: int = 1000) -> Sequence:
    # distinct tokens per seq (unless a test wants shared prefixes), so no accidental cache hits
    tokens = [base + seq_id * 1000 + i for i in range(prompt_len)]
    return Sequence(seq_id, tokens, SamplingParams(temperature=0, max_tokens=max_tokens))


def _sampled(batch: ScheduledBatch) -> list[Sequence]:
    """The seqs of an advanced batch whose prompt is all computed: they sample a token
    (the engine learns this from the runner)."""
    return [s for s in batch.seqs if s.num_computed_tokens == len(s)]


def _step(sched: Scheduler) -> ScheduledBatch:
    """One engine step without a model; finishes seqs that reached max_tokens."""
    batch = sched.schedule()
    sched.advance(batch)
    for seq in _sampled(batch):
        seq.token_ids.append(FAKE_TOKEN)
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            sched.finish(seq, "length")
    return batch


def _run(sched: Scheduler, max_steps: int = 10_000) -> list[ScheduledBatch]:
    batches = []
    while sched.has_work():
        batches.append(_step(sched))
        assert len(batches) < max_steps, "no progress"
    return batches


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.tuples(st.integers(1, 60), st.integers(1, 12)), min_size=1, max_size=10),
       budget=st.integers(1, 48), max_num_seqs=st.integers(1, 6), extra_blocks=st.integers(0, 8),
       shared=st.booleans())
def test_random_workloads_respect_limits_and_finish(lens, budget, max_num_seqs, extra_blocks, shared):
    block_size = 4
    max_len = max(p + m for p, m in lens)
    # the cache must hold at least one sequence of the longest length
    bm, sched = _make(-(-max_len // block_size) + extra_blocks, block_size, max_num_seqs=max_num_seqs,
                      max_num_batched_tokens=budget, max_model_len=max_len + 1)
    seqs = []
    for i, (p, m) in enumerate(lens):
        s = _seq(i, p, m)
        if shared:  # every prompt starts with the same tokens: prefix-cache hits
            s.token_ids = [7] * p
        seqs.append(s)
        sched.add(s)
    while sched.has_work():
        before = {s.seq_id: s.num_computed_tokens for s in sched.running}
        batch = _step(sched)
        assert batch.total_tokens <= budget
        assert len(sched.running) <= max_num_seqs
        assert len({s.seq_id for s in batch.seqs}) == len(batch.seqs)
        assert all(n >= 1 for n in batch.num_tokens)
        assert batch.seqs or batch.preempted, "a step with work did nothing"
        for s in batch.preempted:
            assert s.block_table == [] and s.num_computed_tokens == 0 and s.status == SequenceStatus.WAITING
            assert s not in batch.seqs and s in sched.waiting
        for s, n in zip(batch.seqs, batch.num_tokens):
            assert len(s.block_table) * block_size >= s.num_computed_tokens, "KV slots missing"
            if s.seq_id in before and not s.is_finished:
                assert s.num_computed_tokens == before[s.seq_id] + n
        bm.check_invariants()
        assert sum(b.ref_count for b in bm.blocks) == sum(len(s.block_table) for s in sched.running)
        assert sum(s.num_preemptions for s in seqs) < 50 * len(seqs), "thrashing"
    for s, (p, m) in zip(seqs, lens):
        assert s.is_finished and s.num_output_tokens == m and len(s.token_ids) == p + m
    assert bm.num_free_blocks == bm.num_blocks


def test_chunked_prefill_splits_a_long_prompt_into_budget_chunks():
    bm, sched = _make(64, max_num_batched_tokens=32, max_model_len=256)
    seq = _seq(0, 100, max_tokens=3)
    sched.add(seq)
    chunks, ready_after = [], []
    while sched.has_work():
        batch = sched.schedule()
        chunks.append(batch.num_tokens)
        sched.advance(batch)
        ready = _sampled(batch)
        ready_after.append(bool(ready))
        for s in ready:
            s.token_ids.append(FAKE_TOKEN)
            if s.num_output_tokens >= 3:
                sched.finish(s, "length")
    assert chunks == [[32], [32], [32], [4], [1], [1]]
    assert ready_after == [False, False, False, True, True, True], "sampled before the prompt was done"
    assert bm.num_free_blocks == 64


def test_decodes_come_first_and_prefill_chunks_use_the_rest_of_the_budget():
    bm, sched = _make(64, max_num_batched_tokens=16, max_model_len=256)
    a, b = _seq(0, 4, max_tokens=10), _seq(1, 40, max_tokens=2)
    sched.add(a)
    assert _step(sched).num_tokens == [4]
    sched.add(b)
    batch = _step(sched)
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 15]
    batch = _step(sched)
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 15]
    batch = _step(sched)
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 10]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    bm, sched = _make(64, max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    a, b = _seq(0, 40, max_tokens=5), _seq(1, 40, max_tokens=5)
    sched.add(a)
    sched.add(b)
    batch = _step(sched)
    assert batch.seqs == [a] and batch.num_tokens == [40]
    batch = _step(sched)
    assert batch.seqs == [a, b] and batch.num_tokens == [1, 40]


def test_max_num_seqs_limits_the_running_set():
    bm, sched = _make(64, max_num_seqs=2, max_num_batched_tokens=256)
    seqs = [_seq(i, 5, max_tokens=3) for i in range(5)]
    for s in seqs:
        sched.add(s)
    batch = _step(sched)
    assert batch.seqs == seqs[:2]
    max_running = 0
    while sched.has_work():
        _step(sched)
        max_running = max(max_running, len(sched.running))
        assert len(sched.running) <= 2
    assert max_running == 2
    assert all(s.num_output_tokens == 3 for s in seqs)


def test_admission_is_first_come_first_served():
    rng = random.Random(0)
    bm, sched = _make(40, max_num_seqs=3, max_num_batched_tokens=24, max_model_len=128)
    seqs = [_seq(i, rng.randint(1, 50), max_tokens=rng.randint(1, 6)) for i in range(12)]
    for s in seqs:
        sched.add(s)
    first_seen: list[int] = []
    for batch in _run(sched):
        for s in batch.seqs:
            if s.seq_id not in first_seen:
                first_seen.append(s.seq_id)
    assert first_seen == list(range(12))


def test_head_of_queue_that_does_not_fit_blocks_later_ones():
    bm, sched = _make(8, max_num_batched_tokens=64, max_model_len=32)
    big_running = _seq(0, 20, max_tokens=8)  # 5 blocks
    sched.add(big_running)
    _step(sched)
    big_waiting, small = _seq(1, 16, max_tokens=2), _seq(2, 2, max_tokens=2)  # 4 blocks, 1 block
    sched.add(big_waiting)
    sched.add(small)
    batch = _step(sched)
    assert batch.seqs == [big_running], "a later request overtook the head of the queue"
    assert list(sched.waiting) == [big_waiting, small]


def test_preemption_frees_the_newest_seq_and_requeues_it_first():
    # 6 blocks of 4 tokens; two 8-token prompts take 4 blocks, then decoding runs out
    bm, sched = _make(6, max_num_batched_tokens=64, max_model_len=24)
    a, b, c = _seq(0, 8, max_tokens=12), _seq(1, 8, max_tokens=12), _seq(2, 20, max_tokens=1)
    sched.add(a)
    sched.add(b)
    batch = _step(sched)
    assert batch.seqs == [a, b]
    sched.add(c)  # cannot fit while a and b hold their blocks
    preempting = None
    for _ in range(20):
        b_tokens = list(b.token_ids)
        batch = _step(sched)
        if batch.preempted:
            preempting = batch
            break
        assert batch.seqs == [a, b]
    assert preempting is not None, "ran out of blocks without preempting"
    assert preempting.preempted == [b] and preempting.seqs == [a]
    assert b.block_table == [] and b.num_computed_tokens == 0
    assert b.status == SequenceStatus.WAITING and b.num_preemptions == 1
    assert b.token_ids == b_tokens, "preemption must keep the generated tokens"
    assert list(sched.waiting) == [b, c], "the preempted seq goes back to the front"
    assert sched.running == [a]
    assert bm.num_free_blocks == bm.num_blocks - len(a.block_table)
    bm.check_invariants()
    _run(sched)
    assert sched.num_preemptions >= 1
    # b's first block was freed last, so a did not reuse it: b's recompute starts from it
    assert b.num_cached_tokens > 0, "the recompute did not use b's cached prefix"
    for s, m in ((a, 12), (b, 12), (c, 1)):
        assert s.is_finished and s.num_output_tokens == m
    assert bm.num_free_blocks == bm.num_blocks
