"""A decode worker's n > 1 request: one reservation and one KVReady carrying every
choice's first token; each choice's entries carry its index and it ends with its own last
entry; a stopped choice (the router's abort with an index) ends alone; a KVReady without
one first token per choice fails the request; every block comes back."""
from __future__ import annotations

import pytest

from pdserve.common.wire.messages import AbortRequest, ErrorReply, KVReady, RequestOutput
from pdserve.common.wire.transport import Incoming
from pdserve.decode_node.peers import PeerMessage
from pdserve.decode_node.requests import State
from tests.support.decode_harness import make_harness, nblocks, prompt


@pytest.fixture
def h(decode_config):
    harness = make_harness(decode_config)
    try:
        yield harness
    finally:
        harness.worker.close()


def ready(h, rid: str, forks: list[int]) -> None:
    msg = KVReady(rid, 7, len(h.prefill_request(rid).dst_block_ids), fork_tokens=forks)
    h.worker.on_peer_events([PeerMessage(h.peer, Incoming(None, msg, []))])


def entries(h, rid: str) -> list[RequestOutput]:
    return [m for m in h.server.replies(rid) if isinstance(m, RequestOutput)]


def check_clean(h) -> None:
    bm = h.worker.engine.block_manager
    bm.check_invariants()
    assert len(h.worker.requests) == 0 and bm.num_free_blocks == h.baseline
    s = h.worker.engine.scheduler
    assert not s.waiting and not s.running and not s.reserved


def test_choices_fork_on_landing_and_end_one_by_one(h):
    h.generate("a", prompt(37, 1), max_tokens=6, n=3)
    h.worker.try_reserve()
    assert len(h.client.prefill_requests()) == 1 and h.held("a") == nblocks(37)  # one reservation for all
    ready(h, "a", [8, 9])
    assert h.state("a") == State.RUNNING
    assert h.free == h.baseline - nblocks(37) - 2  # the partial block copied for each fork
    h.turn()
    h.worker.handle(Incoming(b"router-a", AbortRequest("a", 1), []))  # a stop string in choice 1
    h.run_until_idle()
    outs = entries(h, "a")
    firsts = {i: next(o.token_ids[0] for o in outs if o.index == i) for i in range(3)}
    assert firsts == {0: 7, 1: 8, 2: 9}
    last = {o.index: o.finish_reason for o in outs if o.finished}
    assert last == {0: "length", 1: "abort", 2: "length"}
    assert all(sum(len(o.token_ids) for o in outs if o.index == i) == 6 for i in (0, 2))
    assert sum(o.finished for o in outs) == 3  # one last entry per choice
    check_clean(h)


def test_abort_answers_every_choice_once(h):
    h.generate("a", prompt(20, 2), max_tokens=50, n=4)
    h.worker.try_reserve()
    ready(h, "a", [8, 9, 10])
    h.turn()
    h.abort("a")
    h.run_until_idle()
    last = [o for o in entries(h, "a") if o.finished]
    assert sorted(o.index for o in last) == [0, 1, 2, 3] and {o.finish_reason for o in last} == {"abort"}
    check_clean(h)


@pytest.mark.parametrize("forks", [[8], [8, 9, 10]])
def test_kv_ready_without_a_first_token_per_choice_fails(h, forks):
    h.generate("a", prompt(20, 3), max_tokens=5, n=3)
    h.worker.try_reserve()
    ready(h, "a", forks)
    (err,) = [m for m in h.server.replies("a") if isinstance(m, ErrorReply)]
    assert err.code == "transfer_error" and "for 3 choices" in err.message
    check_clean(h)
