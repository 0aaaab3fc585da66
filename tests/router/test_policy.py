"""Routing choices (router/core/policy.py): pure functions over WorkerView lists."""
from __future__ import annotations

import random
from collections import Counter

import pytest

from pdserve.router.core.policy import POLICIES, ImbalanceGuard, WorkerView, choose_decode, choose_prefill, prefix_overlap


def view(wid: str, load: int = 0, prefix: int = 0, free: int = 100, total: int = 100, queued: int = 0) -> WorkerView:
    return WorkerView(wid, load=load, free_blocks=free, total_blocks=total, prefix_blocks=prefix, queued_blocks=queued)


def picks(choose, cands, policy: str, seeds=range(200)) -> Counter:
    return Counter(choose(cands, policy, random.Random(s)) for s in seeds)


# ---- prefill: prefix affinity vs load ------------------------------------------------

def test_prefix_affinity_picks_longest_overlap():
    cands = [view("a", load=0, prefix=1), view("b", load=2, prefix=3), view("c", load=0, prefix=0)]
    assert picks(choose_prefill, cands, "prefix_load") == {"b": 200}


def test_prefix_tie_goes_to_the_less_loaded():
    cands = [view("a", load=3, prefix=2), view("b", load=1, prefix=2), view("c", load=0, prefix=1)]
    assert picks(choose_prefill, cands, "prefix_load") == {"b": 200}


def test_no_overlap_anywhere_picks_least_loaded():
    cands = [view("a", load=2), view("b", load=1), view("c", load=3)]
    assert choose_prefill(cands, "prefix_load", random.Random(0)) == "b"


def test_a_shared_first_block_does_not_outweigh_a_queue():
    # every conversation starts with the same system-prompt block: the worker that cached it
    # has a 45-block prompt queued, the other nothing -- the queue costs more than the block saves
    cands = [view("hot", load=1, prefix=1, queued=45), view("cold", load=0)]
    assert picks(choose_prefill, cands, "prefix_load") == {"cold": 200}


def test_a_prefix_saving_more_than_the_queue_holds_wins():
    # 10 cached blocks against 6 queued: 4 blocks less to wait for and compute than on "cold"
    cands = [view("hot", load=1, prefix=10, queued=6), view("cold", load=0)]
    assert picks(choose_prefill, cands, "prefix_load") == {"hot": 200}
    # saving exactly what it queues: the same cost, so the less loaded
    even = [view("hot", load=1, prefix=6, queued=6), view("cold", load=0)]
    assert picks(choose_prefill, even, "prefix_load") == {"cold": 200}


def test_imbalance_guard_overrides_prefix_affinity():
    # 20 > 2 * 1 + 4: badly imbalanced, so the cached prefix on "hot" does not matter
    cands = [view("hot", load=20, prefix=8), view("cold", load=1, prefix=0), view("warm", load=5, prefix=2)]
    assert picks(choose_prefill, cands, "prefix_load") == {"cold": 200}


def test_imbalance_guard_boundary():
    guard = ImbalanceGuard()  # max > 2 * min + 4
    assert not guard.imbalanced([6, 1]) and guard.imbalanced([7, 1])
    at_limit = [view("hot", load=6, prefix=4), view("cold", load=1)]
    past_limit = [view("hot", load=7, prefix=4), view("cold", load=1)]
    assert choose_prefill(at_limit, "prefix_load", random.Random(0)) == "hot"
    assert choose_prefill(past_limit, "prefix_load", random.Random(0)) == "cold"


def test_custom_imbalance_guard():
    cands = [view("hot", load=3, prefix=4), view("cold", load=1)]
    assert choose_prefill(cands, "prefix_load", random.Random(0)) == "hot"
    strict = ImbalanceGuard(ratio=1.0, slack=1)  # 3 > 1 * 1 + 1
    assert choose_prefill(cands, "prefix_load", random.Random(0), guard=strict) == "cold"


# ---- random tie breaking -----------------------------------------------------------

@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_ties_cover_every_tied_worker(choose):
    cands = [view("a", load=1, prefix=2), view("b", load=1, prefix=2), view("c", load=1, prefix=2),
             view("loser", load=2, prefix=2, free=50)]
    seen = picks(choose, cands, "prefix_load")
    assert set(seen) == {"a", "b", "c"}
    assert min(seen.values()) > 30, f"tie breaking is far from uniform: {seen}"


@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_tie_breaking_is_deterministic_per_seed(choose):
    cands = [view(w, load=1, prefix=1) for w in "abcdef"]
    for seed in range(50):
        first = [choose(cands, "prefix_load", rng) for rng in [random.Random(seed)] for _ in range(5)]
        again = [choose(cands, "prefix_load", rng) for rng in [random.Random(seed)] for _ in range(5)]
        assert first == again


def test_least_loaded_ties_are_random_too():
    cands = [view("a", load=0), view("b", load=0), view("c", load=4)]
    assert set(picks(choose_prefill, cands, "least_loaded")) == {"a", "b"}
    assert set(picks(choose_decode, cands, "least_loaded")) == {"a", "b"}


# ---- round robin, least loaded -----------------------------------------------------

@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_round_robin_cycles_in_id_order_ignoring_load_and_cache(choose):
    cands = [view("w2", load=50, prefix=9), view("w0", load=0), view("w1", load=9, free=0)]
    got = [choose(cands, "round_robin", random.Random(0), rr_index=i) for i in range(7)]
    assert got == ["w0", "w1", "w2", "w0", "w1", "w2", "w0"]


@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_least_loaded_ignores_prefix_and_free_blocks(choose):
    cands = [view("cached", load=3, prefix=10, free=100), view("idle", load=1, prefix=0, free=10),
             view("busy", load=2, prefix=5, free=90)]
    assert picks(choose, cands, "least_loaded") == {"idle": 200}


# ---- decode: free blocks, then fewer running ---------------------------------------

def test_decode_prefers_most_free_blocks():
    cands = [view("a", load=0, free=100, total=200), view("b", load=9, free=150, total=200),
             view("c", load=0, free=20, total=200)]
    assert picks(choose_decode, cands, "prefix_load") == {"b": 200}


def test_decode_compares_free_blocks_as_a_share_of_the_cache():
    # "big" has more free blocks but a smaller free share
    cands = [view("big", free=150, total=300), view("small", free=100, total=100)]
    assert choose_decode(cands, "prefix_load", random.Random(0)) == "small"


def test_decode_equal_free_share_prefers_fewer_running():
    cands = [view("a", load=3, free=64, total=128), view("b", load=1, free=32, total=64),
             view("c", load=2, free=64, total=128)]
    assert picks(choose_decode, cands, "prefix_load") == {"b": 200}


def test_decode_ignores_prefix_overlap():
    cands = [view("cached", load=0, prefix=9, free=50), view("roomy", load=0, prefix=0, free=90)]
    assert choose_decode(cands, "prefix_load", random.Random(0)) == "roomy"


# ---- bad input -----------------------------------------------------------------------

@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_empty_candidate_list_raises(choose, policy):
    with pytest.raises(ValueError, match="no live worker"):
        choose([], policy, random.Random(0))


@pytest.mark.parametrize("choose", [choose_prefill, choose_decode])
def test_unknown_policy_raises(choose):
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose([view("a"), view("b", load=1)], "fastest", random.Random(0))


def test_unknown_policy_raises_even_when_load_is_imbalanced():
    # choose_prefill checks the imbalance guard before it validates the policy name, so a
    # misspelled policy is silently treated as least_loaded whenever load is imbalanced
    with pytest.raises(ValueError, match="unknown routing policy"):
        choose_prefill([view("a", load=20), view("b", load=0)], "fastest", random.Random(0))


# ---- helpers -------------------------------------------------------------------------

def test_prefix_overlap_counts_leading_blocks_only():
    assert prefix_overlap([1, 2, 3, 4], {1, 2, 4}) == 2
    assert prefix_overlap([1, 2, 3], {2, 3}) == 0
    assert prefix_overlap([1, 2, 3], {1, 2, 3, 9}) == 3
    assert prefix_overlap([], {1}) == 0


def test_free_ratio():
    assert view("a", free=25, total=100).free_ratio == 0.25
    assert view("a", free=0, total=0).free_ratio == 0.0
