"""The decode request table alone: which transitions it allows, that terminal states
leave it, and its ordered queries (no worker, no model)."""
from __future__ import annotations

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.decode_node.requests import TERMINAL, TRANSITIONS, DecodeRequest, RequestTable, State, TransitionError
from tests.support.decode_harness import P_ADDR


def _req(rid: str, seq_id: int) -> DecodeRequest:
    from pdserve.common.engine.sequence import Sequence
    return DecodeRequest(rid, Sequence(seq_id, [5, 6, 7], SamplingParams()), b"x", P_ADDR, False)


def test_table_allows_exactly_the_listed_transitions():
    for src in State:
        for dst in State:
            table = RequestTable()
            req = _req("r", 1)
            table.add(req)
            req.state = src  # put it there directly: `move` is what is under test
            allowed = dst in TRANSITIONS.get(src, frozenset())
            if allowed:
                table.move(req, dst)
                assert req.state == dst
                assert (("r" in table) == (dst not in TERMINAL)) and len(table) == (0 if dst in TERMINAL else 1)
                assert (table.by_seq(1) is None) == (dst in TERMINAL)
            else:
                with pytest.raises(TransitionError):
                    table.move(req, dst)
                assert req.state == src and "r" in table and table.by_seq(1) is req
    for t in TERMINAL:
        assert t not in TRANSITIONS, "a terminal state has no way out"
    assert State.DRAINING not in TRANSITIONS[State.PENDING], "a PENDING request holds nothing to drain"


def test_table_orders_and_counts():
    table = RequestTable()
    reqs = [_req(f"r{i}", i) for i in range(4)]
    for r in reqs:
        table.add(r)
    table.move(reqs[1], State.RESERVED)
    table.move(reqs[3], State.RESERVED)
    assert [r.request_id for r in table.in_state(State.PENDING)] == ["r0", "r2"]
    assert [r.request_id for r in table.in_state(State.RESERVED, State.PENDING)] == ["r0", "r1", "r2", "r3"]
    assert table.count(State.RESERVED) == 2
    # iterating while moving is safe: in_state returns a snapshot
    for r in table.in_state(State.PENDING):
        table.move(r, State.ABORTED)
    assert len(table) == 2 and table.get("r0") is None and table.get("r1") is reqs[1]
    with pytest.raises(TransitionError):
        table.move(reqs[0], State.RUNNING)  # a terminal request cannot come back
    with pytest.raises(AssertionError):
        table.add(_req("r1", 9))  # ids are unique among live requests
