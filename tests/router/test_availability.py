"""Which workers a request may go to, how a deployment serves with a pool empty, and how
long a request waits when nothing can serve it (router/core/availability.py); who failed
an attempt, so that its retry goes elsewhere (router/core/recovery.py). Pure functions:
no sockets, no clocks."""
from __future__ import annotations

import pytest

from pdserve.router.core.availability import (COLOCATED, DECODE_LOCAL, DEGRADED, NONE, OK, PREFILL_DECODE,
                                              UNAVAILABLE, Liveness, hold_left_s, plan, routable, serving_state,
                                              suspected)
from pdserve.router.core.recovery import blamed

SUSPECT_S = 1.5


def w(wid: str, role: str = "prefill", serving: bool = True, silent_s: float = 0.1, error: bool = False,
      address: str = "") -> Liveness:
    return Liveness(wid, address or f"tcp://h:{wid}", role, serving, silent_s, error)


def test_a_worker_is_suspected_once_it_misses_heartbeats_or_its_connection_fails():
    assert not suspected(w("p0", silent_s=SUSPECT_S), SUSPECT_S)  # on the boundary: still heard in time
    assert suspected(w("p0", silent_s=SUSPECT_S + 0.01), SUSPECT_S)
    assert suspected(w("p0", silent_s=0.0, error=True), SUSPECT_S)  # at once, however recently it was heard


def test_routable_leaves_out_the_suspected_the_not_serving_and_those_that_failed_the_request():
    workers = [w("p0"), w("p1", silent_s=3.0), w("p2", error=True), w("p3", serving=False), w("d0", "decode"),
               w("d1", "decode"), w("c0", "colocated")]
    assert routable(workers, SUSPECT_S) == {"prefill": ["p0"], "decode": ["d0", "d1"], "colocated": ["c0"]}
    avoid = frozenset({"tcp://h:p0", "tcp://h:d1"})
    assert routable(workers, SUSPECT_S, avoid) == {"prefill": [], "decode": ["d0"], "colocated": ["c0"]}


def test_a_worker_restarted_at_a_new_address_is_not_avoided():
    """A retry avoids the process that failed it, not the name a restart reuses."""
    again = w("p0", address="tcp://h:new")
    assert routable([again], SUSPECT_S, frozenset({"tcp://h:p0"}))["prefill"] == ["p0"]


@pytest.mark.parametrize("roles, how, state", [
    (("prefill", "decode"), PREFILL_DECODE, OK),
    (("prefill", "decode", "colocated"), PREFILL_DECODE, OK),
    (("colocated",), COLOCATED, OK),
    (("decode", "colocated"), COLOCATED, OK),  # a colocated worker is made for local prompts: no degradation
    (("decode",), DECODE_LOCAL, DEGRADED),  # the prefill pool is empty: D prefills, degraded
    (("prefill",), NONE, UNAVAILABLE),  # a prefill worker alone serves nothing
    ((), NONE, UNAVAILABLE),
])
def test_plans_best_first(roles, how, state):
    cands = {r: [f"{r}-0"] if r in roles else [] for r in ("prefill", "decode", "colocated")}
    assert plan(cands) == how and serving_state(how) == state


def test_suspected_prefill_workers_make_the_deployment_degraded_not_down():
    """The prefill worker just died (its connection closed): its decode worker serves on."""
    cands = routable([w("p0", error=True), w("d0", "decode")], SUSPECT_S)
    assert plan(cands) == DECODE_LOCAL and serving_state(plan(cands)) == DEGRADED
    cands = routable([w("p0"), w("d0", "decode", silent_s=2.0)], SUSPECT_S)  # no decode worker heard lately
    assert plan(cands) == NONE


def test_hold_left_counts_from_one_start_and_never_goes_negative():
    assert hold_left_s(100.0, 100.0, 10.0) == 10.0
    assert hold_left_s(100.0, 104.0, 10.0) == 6.0  # a second hold of the same request: what is left
    assert hold_left_s(100.0, 110.0, 10.0) == 0.0
    assert hold_left_s(100.0, 250.0, 10.0) == 0.0
    assert hold_left_s(100.0, 100.0, 0.0) == 0.0  # worker_wait_s 0: refused at once


# ---- who failed an attempt (router/core/recovery.py) --------------------------------------

P, D = "tcp://h:p0", "tcp://h:d0"


def test_the_router_names_the_dead_or_suspected_worker():
    assert blamed("worker_failed", D, P, frozenset({P})) == {P}
    assert blamed("worker_failed", D, P, frozenset({D})) == {D}
    assert blamed("worker_failed", D, P, frozenset({P, D})) == {P, D}
    assert blamed("worker_failed", D, P, frozenset({"tcp://h:other"})) == {P}  # someone else's trouble


def test_a_decode_worker_that_answers_blames_its_prefill_worker():
    """D answered: its prefill worker or the transfer from it failed, not D."""
    for code in ("worker_failed", "transfer_timeout", "transfer_error"):
        assert blamed(code, D, P, frozenset()) == {P}


def test_a_draining_decode_worker_or_one_that_computed_the_prompt_is_blamed_itself():
    assert blamed("worker_draining", D, P, frozenset()) == {D}  # it refused the request: the retry goes elsewhere
    assert blamed("worker_failed", D, None, frozenset()) == {D}


def test_the_knobs_are_checked_at_the_edge(model_dirs):
    from pdserve.common.config import ConfigError
    from pdserve.router.core.config import RouterConfig

    model = model_dirs["qwen3"]
    assert RouterConfig(model_dir=model, worker_wait_s=0).worker_wait_s == 0  # refused at once
    for bad in ({"worker_wait_s": -1}, {"worker_wait_s": 1e6}, {"suspect_after_s": 0}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            RouterConfig(model_dir=model, **bad)
