"""The decode worker reads time only through its clock (common/clock.py): driven by a
ManualClock, a reservation's lease expires exactly when that clock passes lease_s and
never before, whatever the wall clock does, and the timeline's stamps are that clock's."""
from __future__ import annotations

from pdserve.common.clock import ManualClock
from pdserve.common.wire.messages import ErrorReply
from tests.support.decode_harness import NUM_BLOCKS, make_harness, prompt
from pdserve.decode_node.requests import State


def test_lease_and_timeline_follow_the_injected_clock(decode_config):
    clock = ManualClock(start=100.0, epoch=5000.0)
    h = make_harness(decode_config, clock=clock, lease_s=2.0)
    try:
        h.generate("a", prompt(40, 3), max_tokens=2, return_timeline=True)
        h.turn()  # reserved, PrefillRequest sent
        assert h.state("a") == State.RESERVED
        req = h.req("a")
        assert req.timeline["decode_arrival"] == 5100.0 and req.timeline["decode_reserved"] == 5100.0
        clock.advance(1.999)
        h.turn()
        assert h.state("a") == State.RESERVED  # not yet: 1.999 s of the clock's time
        clock.advance(0.002)
        h.turn()  # the lease has run out on this clock: answered, blocks held until P is fenced
        assert [r.code for r in h.server.replies("a") if isinstance(r, ErrorReply)] == ["transfer_timeout"]
        assert h.state("a") == State.DRAINING
        h.prefill_failed("a", "aborted")  # P answers the abort: fenced, released
        assert h.state("a") is None
        assert h.worker.engine.block_manager.num_free_blocks == NUM_BLOCKS
    finally:
        h.worker.close()


def test_a_local_request_is_stamped_by_the_clock(decode_config):
    clock = ManualClock(start=0.0, epoch=7000.0)
    h = make_harness(decode_config, clock=clock)
    try:
        h.generate("b", prompt(20, 4), max_tokens=2, local=True, return_timeline=True)
        clock.advance(0.5)
        h.turn()
        clock.advance(0.25)
        h.turn()
        last = h.server.replies("b")[-1]
        assert last.finished
        stamps = last.timeline
        assert stamps["decode_arrival"] == stamps["prefill_queued"] == 7000.0
        assert stamps["prefill_start"] == 7000.5 and stamps["finish"] == 7000.75
    finally:
        h.worker.close()
