"""The pure parts of speculative decoding: prompt lookup (common/engine/spec/ngram.py), the
policy that decides how many drafts pay (spec/policy.py), and the scheduler's and block
manager's share (drafts scheduled with their sequence, given up before anyone is
preempted, their room taken back)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.common.config import SchedulerConfig
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.scheduler import Scheduler
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.spec.ngram import lookup
from pdserve.common.engine.spec.policy import PROBE_EVERY, PROBE_SHARE, AdaptivePolicy, LinearCost, expected_tokens
from pdserve.common.sampling_params import SamplingParams


@pytest.mark.parametrize("tokens, k, lo, hi, want", [
    ([1, 2, 3, 4, 9, 1, 2, 3], 3, 1, 3, [4, 9, 1]),       # the 3-gram 1 2 3 occurred: what followed it
    ([1, 2, 3, 4, 9, 1, 2, 3], 8, 1, 3, [4, 9, 1, 2, 3]),  # no more than there is
    ([5, 1, 2, 7, 1, 2, 8, 1, 2], 2, 2, 2, [8, 1]),       # the latest occurrence
    ([5, 1, 2, 7, 6, 2], 2, 2, 4, []),                    # no 2-gram repeats; 1-grams not allowed
    ([5, 1, 2, 7, 6, 2], 2, 1, 4, [7, 6]),                # the 1-gram 2 does
    ([4, 4, 4, 4], 3, 1, 3, [4]),                         # overlapping: the suffix itself is never a match
    ([7], 2, 1, 3, []),
])
def test_prompt_lookup(tokens, k, lo, hi, want):
    assert lookup(tokens, k, lo, hi) == want


def _lookup_reference(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, by brute force."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[len(tokens) - n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=300, deadline=None, derandomize=True)
@given(st.lists(st.sampled_from([0, 1, 2, 256, 257, 65536, 2**24 + 1, 2**31 - 1]), max_size=40),
       st.integers(1, 6), st.integers(1, 3), st.integers(1, 5))
def test_prompt_lookup_equals_its_definition(tokens, k, lo, span):
    """Few distinct ids (many repeats), and ids whose bytes make unaligned matches in the
    4-byte search buffer (256 = 00 01 00 00 next to 1 = 01 00 00 00, ...)."""
    assert lookup(tokens, k, lo, lo + span - 1) == _lookup_reference(tokens, k, lo, lo + span - 1)


def test_expected_tokens():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_linear_cost_learns_slope_and_intercept():
    cost = LinearCost(slope_ratio=0.1)
    for rows in (1, 5, 1, 3, 5, 2) * 5:
        cost.observe(rows, 0.050 + 0.006 * rows)
    a, b = cost.fit()
    assert a == pytest.approx(0.050, rel=0.05) and b == pytest.approx(0.006, rel=0.1)
    flat = LinearCost(slope_ratio=0.1)  # rows never varied: the prior's slope
    for _ in range(10):
        flat.observe(4, 0.14)
    assert flat.fit()[1] == pytest.approx(0.1 * 0.14 / 1.4, rel=0.05) and flat.predict(4) == pytest.approx(0.14)


def _policy(step_s: float, per_row_s: float, draft_s: float | None = None, **kw) -> AdaptivePolicy:
    policy = AdaptivePolicy(draft_passes=draft_s is not None, **kw)
    for rows in (1, 5, 2, 8, 1, 4):
        policy.target.observe(rows, step_s + per_row_s * rows)
        if draft_s is not None:
            policy.draft.observe(rows, draft_s)
    return policy


def _record(policy: AdaptivePolicy, seq_id: int, rate: float, times: int = 30, k: int = 4) -> None:
    for _ in range(times):  # verifications that keep round(k * rate) of k drafts each
        policy.record(seq_id, k, round(k * rate))


def test_policy_speculates_where_it_pays_and_stops_where_it_does_not():
    # a weight-bound step: four more rows cost 20% more
    policy = _policy(0.050, 0.0025)
    _record(policy, 1, rate=0.9)
    _record(policy, 2, rate=0.0)
    ks = policy.choose([1, 2], [4, 4], base_rows=2, base_tokens=2)
    assert ks[0] >= 3 and ks[1] == 0
    # a compute-bound batch: a row costs what a step of one row does; only near-certain drafts pay
    heavy = _policy(0.010, 0.010)
    _record(heavy, 1, rate=0.5)
    assert heavy.choose([1], [4], base_rows=8, base_tokens=8) == [0]


def test_a_draft_model_pass_counts_against_its_drafts():
    cheap = _policy(0.050, 0.0025, draft_s=0.005)
    costly = _policy(0.050, 0.0025, draft_s=0.060)
    for p in (cheap, costly):
        _record(p, 1, rate=0.7)
    assert cheap.choose([1], [4], base_rows=1, base_tokens=1)[0] >= 2
    assert costly.choose([1], [4], base_rows=1, base_tokens=1) == [0]


def test_a_sequence_that_stopped_speculating_probes_again():
    policy = _policy(0.050, 0.0025)
    _record(policy, 1, rate=0.0)
    picks = [policy.choose([1], [4], base_rows=1, base_tokens=1)[0] for _ in range(3 * PROBE_EVERY)]
    probes = [i for i, k in enumerate(picks) if k]
    assert len(probes) == 3 and all(picks[i] <= 2 for i in probes), picks  # one short probe per PROBE_EVERY steps


def test_without_adaptivity_every_draft_is_verified():
    policy = _policy(0.010, 0.010, adaptive=False)
    _record(policy, 1, rate=0.0)
    assert policy.choose([1], [3], base_rows=8, base_tokens=8) == [3]


def _running(sched: Scheduler, *lengths: int) -> list[Sequence]:
    """Decoding sequences of these lengths, all but each one's last token computed."""
    seqs = [Sequence(i, list(range(3, 3 + n - 1)), SamplingParams(max_tokens=100)) for i, n in enumerate(lengths)]
    for seq in seqs:
        sched.add(seq)
    sched.advance(sched.schedule())
    for seq in seqs:
        seq.token_ids.append(99)
    return seqs


def test_drafts_are_scheduled_with_their_sequence_and_given_up_first():
    bm = BlockManager(num_blocks=4, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, num_lookahead=4)
    (a,) = _running(sched, 8)  # 8 tokens: 2 blocks, 7 computed
    a.spec_token_ids = [1, 2, 3]
    batch = sched.schedule()
    assert batch.num_tokens == [4] and len(a.block_table) == 3  # last token + 3 drafts: positions 7..10
    a.spec_token_ids = [1, 2, 3]  # the same step again (nothing was advanced)
    sched.config = SchedulerConfig(max_num_batched_tokens=3)  # the budget cuts drafts, never the own token
    assert sched.schedule().num_tokens == [3] and a.spec_token_ids == [1, 2]


def test_no_blocks_for_drafts_means_no_drafts_not_a_preemption():
    bm = BlockManager(num_blocks=3, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, num_lookahead=4)
    a, b = _running(sched, 8, 4)  # 7 and 3 computed: 2 blocks and 1; none left
    assert bm.num_free_blocks == 0
    assert not sched.lookahead(a, 3)  # no room: the proposer is told, nothing taken
    assert len(a.block_table) == 2
    a.spec_token_ids = [1, 2]  # positions 7..9: a third block
    batch = sched.schedule()
    assert batch.num_tokens == [1, 1] and not batch.preempted and a.spec_token_ids == []
    assert b.spec_token_ids == []


def test_rejected_drafts_room_is_taken_back():
    bm = BlockManager(num_blocks=8, block_size=4)
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64), bm, num_lookahead=2)
    (seq,) = _running(sched, 4)  # 4 tokens, 3 computed: 1 block
    assert sched.lookahead(seq, 1 + 6) and len(seq.block_table) == 3  # positions 3..9
    seq.spec_token_ids = [1] * 6
    batch = sched.schedule()
    batch.num_tokens = [2]  # the last token and one accepted draft stand (the engine sets it)
    seq.token_ids.append(1)
    sched.advance(batch)
    seq.token_ids.append(2)  # the target's next token
    # 5 computed + 1 uncomputed + 2 of room: 8 positions, two blocks; the third went back
    assert seq.num_computed_tokens == 5 and len(seq.block_table) == 2 and bm.num_free_blocks == 6
    bm.check_invariants()


def test_probes_in_a_compute_bound_batch_cost_at_most_their_share():
    # 8 sequences whose drafts are all refused, in a batch where a row costs what it computes
    policy = _policy(0.001, 0.010)
    for seq in range(8):
        _record(policy, seq, rate=0.0)
    steps = 40 * PROBE_EVERY
    extra = sum(sum(policy.choose(list(range(8)), [4] * 8, base_rows=8, base_tokens=8)) for _ in range(steps))
    share = extra * 0.010 / (steps * policy.target.predict(8))
    assert 0 < share <= PROBE_SHARE * 1.15, share  # it still probes, within its budget (of predicted time)
    # where rows are nearly free (a weight-bound single stream) every PROBE_EVERY steps, as before
    cheap = _policy(0.050, 0.0025)
    _record(cheap, 1, rate=0.0)
    picks = [cheap.choose([1], [4], base_rows=1, base_tokens=1)[0] for _ in range(3 * PROBE_EVERY)]
    assert sum(1 for k in picks if k) == 3
