"""Workloads of `pdserve bench` (router/bench/workloads.py): random lengths stay in range,
shared-prefix groups share exactly their system prompt, and a scaled Mooncake replay
reuses prefixes exactly as the trace does, on the trace's clock."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.engine.sequence import Sequence
from pdserve.router.bench.workloads import (FIRST_ORDINARY_TOKEN, BenchRequest, ideal_hit_rate, mooncake_workload,
                                    random_workload, shared_prefix_workload)

VOCAB = 1000
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
N_TRACE = 200
SCALE = 32
BLOCK = 512 // SCALE  # 16-token blocks, the block managers' default


def _trace_rows(n: int = N_TRACE, start: int = 0) -> list[dict]:
    with open(TRACE) as f:
        return [json.loads(line) for _, line in zip(range(start + n), f)][start:]


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ---- random -------------------------------------------------------------------------------

def test_random_lengths_stay_in_range():
    reqs = random_workload(300, input_len=100, output_len=20, range_ratio=0.5, vocab=VOCAB, seed=0)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert len(reqs) == 300
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50  # spread over the range
    assert min(outs) >= 10 and max(outs) <= 30
    assert all(FIRST_ORDINARY_TOKEN <= t < VOCAB for r in reqs for t in r.prompt_token_ids)
    assert all(r.arrival is None for r in reqs)  # arrivals come from the arrival process


def test_random_without_range_has_exact_lengths_and_is_seeded():
    reqs = random_workload(20, 64, 16, 0.0, VOCAB, seed=1)
    assert {r.prompt_len for r in reqs} == {64} and {r.output_len for r in reqs} == {16}
    again = random_workload(20, 64, 16, 0.0, VOCAB, seed=1)
    assert [r.prompt_token_ids for r in reqs] == [r.prompt_token_ids for r in again]
    other = random_workload(20, 64, 16, 0.0, VOCAB, seed=2)
    assert [r.prompt_token_ids for r in reqs] != [r.prompt_token_ids for r in other]


# ---- shared prefix ----------------------------------------------------------------------

def test_shared_prefix_groups_share_exactly_the_system_prompt():
    groups, per_group, system_len, question_len = 4, 6, 48, 12
    reqs = shared_prefix_workload(groups, per_group, system_len, question_len, 8, VOCAB, seed=0)
    assert len(reqs) == groups * per_group
    assert all(r.prompt_len == system_len + question_len and r.output_len == 8 for r in reqs)
    by_system: dict[tuple, list[list[int]]] = defaultdict(list)
    for r in reqs:
        by_system[tuple(r.prompt_token_ids[:system_len])].append(r.prompt_token_ids)
    assert len(by_system) == groups and all(len(v) == per_group for v in by_system.values())
    for prompts in by_system.values():  # within a group: the system prompt and nothing more
        assert min(_common_prefix_len(prompts[0], p) for p in prompts[1:]) == system_len
    systems = list(by_system)
    for i, a in enumerate(systems):  # across groups: no shared leading block
        for b in systems[i + 1:]:
            assert _common_prefix_len(list(a), list(b)) < BLOCK
    # shuffled: the groups are interleaved, not laid out one after another
    firsts = [tuple(r.prompt_token_ids[:system_len]) for r in reqs]
    assert any(firsts[i] != firsts[i + 1] for i in range(per_group - 1))


# ---- Mooncake replay ----------------------------------------------------------------------

def _trace_reuse(rows: list[dict], block: int, scale: int, max_input: int | None = None) -> float:
    """Block-level prefix reuse straight from the trace's hash ids. A request of L (scaled)
    tokens looks up its first (L - 1) // block blocks (the final token is always computed),
    and afterwards holds all L // block full blocks in the cache. Mooncake hash ids are
    prefix-chained, so the id of block i names the whole prefix up to it."""
    seen: set[int] = set()
    looked = hits = 0
    for row in rows:
        length = max(1, row["input_length"] // scale)
        if max_input:
            length = min(length, max_input)
        lookups = row["hash_ids"][:(length - 1) // block]
        looked += len(lookups)
        hits += sum(h in seen for h in lookups)
        seen.update(row["hash_ids"][:length // block])
    return hits / looked


@pytest.fixture(scope="module")
def trace_rows() -> list[dict]:
    return _trace_rows()


@pytest.fixture(scope="module")
def replay() -> list[BenchRequest]:
    return mooncake_workload(TRACE, N_TRACE, SCALE, VOCAB, seed=0)


def test_trace_hash_ids_are_prefix_chained(trace_rows):
    """The premise of the reuse checks: one id never follows two different prefixes."""
    parent: dict[int, tuple] = {}
    for row in trace_rows:
        for i, h in enumerate(row["hash_ids"]):
            assert parent.setdefault(h, tuple(row["hash_ids"][:i])) == tuple(row["hash_ids"][:i])


def test_mooncake_lengths_are_scaled(trace_rows, replay):
    assert len(replay) == N_TRACE
    for row, r in zip(trace_rows, replay):
        assert r.prompt_len == max(1, row["input_length"] // SCALE)
        assert r.output_len == max(1, row["output_length"] // SCALE)
    capped = mooncake_workload(TRACE, N_TRACE, SCALE, VOCAB, max_input=300, max_output=20)
    assert max(r.prompt_len for r in capped) == 300 and max(r.output_len for r in capped) == 20
    assert all(a.prompt_token_ids[:b.prompt_len] == b.prompt_token_ids for a, b in zip(replay, capped))


def test_mooncake_same_hash_id_same_token_block(trace_rows, replay):
    content: dict[int, tuple[int, ...]] = {}
    for row, r in zip(trace_rows, replay):
        ids = r.prompt_token_ids
        for i, h in enumerate(row["hash_ids"][:r.prompt_len // BLOCK]):  # the prompt's full blocks
            block = tuple(ids[i * BLOCK:(i + 1) * BLOCK])
            assert content.setdefault(h, block) == block, f"hash id {h} maps to two different blocks"
    assert len(set(content.values())) == len(content)  # different ids, different tokens
    assert len(content) < sum(len(row["hash_ids"]) for row in trace_rows)  # the trace does reuse blocks


def test_mooncake_prefix_reuse_equals_the_traces(trace_rows, replay):
    expected = _trace_reuse(trace_rows, BLOCK, SCALE)
    assert expected > 0.02  # this stretch of the trace does reuse prefixes
    assert ideal_hit_rate(replay, BLOCK) == pytest.approx(expected)
    capped = mooncake_workload(TRACE, N_TRACE, SCALE, VOCAB, max_input=200)
    assert ideal_hit_rate(capped, BLOCK) == pytest.approx(_trace_reuse(trace_rows, BLOCK, SCALE, max_input=200))


@pytest.mark.parametrize("time_scale", [1.0, 4.0, 0.5])
def test_mooncake_arrivals_follow_the_trace_clock(trace_rows, time_scale):
    reqs = mooncake_workload(TRACE, N_TRACE, SCALE, VOCAB, time_scale=time_scale)
    t0 = trace_rows[0]["timestamp"]
    assert [r.arrival for r in reqs] == pytest.approx(
        [(row["timestamp"] - t0) / 1000.0 / time_scale for row in trace_rows])
    assert reqs[-1].arrival > 0


def test_mooncake_start_offset_rebases_time():
    rows = _trace_rows(50, start=300)
    reqs = mooncake_workload(TRACE, 50, SCALE, VOCAB, start=300, time_scale=2.0)
    assert reqs[0].arrival == 0.0
    assert [r.prompt_len for r in reqs] == [max(1, row["input_length"] // SCALE) for row in rows]
    assert reqs[-1].arrival == pytest.approx((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 2000.0)


def test_mooncake_scale_too_large_is_rejected():
    with pytest.raises(ValueError):
        mooncake_workload(TRACE, 5, 1024, VOCAB)


# ---- ideal hit rate -----------------------------------------------------------------------

def _block_manager_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """What a real, never-evicting prefix cache (common.engine.block_manager) hits when the
    prompts are prefilled one after another: cached blocks / blocks looked up."""
    bm = BlockManager(num_blocks=10_000, block_size=block_size)
    for i, ids in enumerate(prompts):
        seq = Sequence(i, list(ids), SamplingParams(temperature=0))
        cached = bm.find_cached_prefix(seq.token_ids)
        bm.admit(seq, cached)
        assert bm.allocate(seq, len(seq) - seq.num_computed_tokens)
        seq.num_computed_tokens = len(seq)
        bm.cache_full_blocks(seq)
        bm.free(seq)
    return bm.num_cached_blocks_hit / bm.num_blocks_queried


def _ids(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_ideal_hit_rate_of_repeated_prompts():
    a = _ids(10, 40)  # 40 tokens: blocks 0, 1 full, (40 - 1) // 16 = 2 looked up
    assert ideal_hit_rate([BenchRequest(a, 1), BenchRequest(a, 1)], 16) == pytest.approx(2 / 4)
    assert ideal_hit_rate([BenchRequest(_ids(10, 40), 1), BenchRequest(_ids(500, 40), 1)], 16) == 0.0
    assert ideal_hit_rate([BenchRequest(_ids(10, 10), 1)], 16) == 0.0  # no full block at all


def test_ideal_hit_rate_counts_a_prompts_final_full_block():
    """A prompt of exactly 2 blocks looks up only block 0 (its final token is computed),
    but once prefilled both its full blocks are in the cache; a later prompt that extends
    it hits both. The ideal (infinite, perfectly routed) cache must hit at least what
    the real block manager does."""
    block = 16
    a = _ids(10, 2 * block)          # looks up 1 block, then caches 2
    b = a + _ids(900, block + 1)     # looks up 3 blocks: 0 and 1 are cached by a
    prompts = [a, b]
    real = _block_manager_hit_rate(prompts, block)
    assert real == pytest.approx(2 / 4)
    assert ideal_hit_rate([BenchRequest(p, 1) for p in prompts], block) == pytest.approx(real)


def test_ideal_hit_rate_matches_block_manager_on_the_trace(replay):
    prompts = [r.prompt_token_ids for r in replay]
    assert ideal_hit_rate(replay, BLOCK) == pytest.approx(_block_manager_hit_rate(prompts, BLOCK))
