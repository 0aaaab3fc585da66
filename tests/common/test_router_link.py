"""A worker's view of its router (common/worker/router_link.py): the states a joined
worker goes through when its router dies and another comes back, and the connection
facts they are read from (a Client's watch: connected, handshakes), on real sockets.
tests/deploy/test_netns_router_death.py runs the whole of it across namespaces."""
from __future__ import annotations

import time

import zmq

from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.wire.messages import StatusRequest
from pdserve.common.wire.transport import Client, Server
from pdserve.common.worker.router_link import EXIT_ROUTER_LOST, RouterLink


def test_a_router_that_comes_back_in_time_gets_a_hello_and_its_requests_are_given_up_once():
    link = RouterLink(lost_after_s=2, give_up_after_s=10, now=0)
    assert link.observe(False, 0, 1) is None  # not connected yet: nothing to give up, no hello to repeat
    assert link.observe(True, 1, 3) is None  # the first connection: run() said hello already
    assert link.observe(False, 1, 4) is None  # down at 4
    assert link.observe(False, 1, 5.9) is None
    assert link.observe(False, 1, 6) == "lost"  # 2 s down: give up what it sent
    assert link.observe(False, 1, 7) is None  # once per outage
    assert link.observe(True, 2, 8) == "back"  # a router at that address again: say hello now
    assert link.observe(True, 2, 9) is None
    assert link.observe(False, 2, 10) is None
    assert link.observe(True, 3, 10.5) == "back"  # a quick restart: never lost, still a new router to greet
    assert link.observe(False, 3, 11) is None
    assert link.observe(False, 3, 13) == "lost"  # a second outage is lost again


def test_no_router_within_the_bound_means_give_up():
    link = RouterLink(lost_after_s=1, give_up_after_s=5, now=0)
    assert link.observe(False, 0, 4.9) is None
    assert link.observe(False, 0, 5) == "give_up"  # a router that never came at all
    link = RouterLink(lost_after_s=1, give_up_after_s=5, now=0)
    link.observe(True, 1, 1)
    link.observe(False, 1, 2)
    assert link.observe(False, 1, 3) == "lost"
    assert link.observe(False, 1, 6.9) is None
    assert link.observe(False, 1, 7) == "give_up"  # 5 s since it went down, not since start
    why = link.why("tcp://10.0.0.1:8002", 7)
    assert "tcp://10.0.0.1:8002" in why and "5 s" in why and "--rejoin-timeout" in why
    assert f"code {EXIT_ROUTER_LOST}" in why


def _until(test, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not test():
        assert time.monotonic() < deadline, "not within the timeout"
        time.sleep(0.02)


def test_the_watch_sees_the_router_go_and_a_new_one_at_its_address():
    key = DeploymentKey(new_secret(), curve=True)
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0", key=key)
    client = Client(ctx, server.address, key=key, watch_handshakes=True, heartbeat=(0.05, 0.3))
    watch = client.handshakes
    try:
        _until(lambda: watch.poll() is None and watch.connected)
        assert watch.handshakes == 1
        server.close()
        _until(lambda: watch.poll() is None and not watch.connected)
        server = Server(ctx, client.address, key=key)  # restarted at the same address, same secret
        _until(lambda: watch.poll() is None and watch.connected)
        assert watch.handshakes == 2
        client.send(StatusRequest())
        assert server.sock.poll(2000)  # the new connection carries messages
    finally:
        client.close()
        server.close()
        ctx.term()
