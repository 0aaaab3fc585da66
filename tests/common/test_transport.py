"""The one rule for a peer-supplied ZeroMQ address (common.wire.transport.is_endpoint),
and the decode worker applying it to a prefill peer's address."""
from __future__ import annotations

import pytest
import zmq

from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.wire.messages import KVHandshake
from pdserve.common.wire.transport import is_endpoint
from pdserve.decode_node.peers import HandshakeError, PrefillPeers

GOOD = ["tcp://127.0.0.1:5555", "tcp://host-1.example:1", "tcp://[::1]:65535", "ipc:///tmp/pdserve/p0"]
BAD = ["inproc://router-internal", "tcp://127.0.0.1:0", "tcp://127.0.0.1:65536", "tcp://:5555", "tcp://host",
       "udp://127.0.0.1:5555", "ipc://", "tcp://127.0.0.1:5555 ", "", "x" * 2000]


@pytest.mark.parametrize("address", GOOD)
def test_endpoints_a_peer_may_name(address):
    assert is_endpoint(address)


@pytest.mark.parametrize("address", BAD)
def test_not_endpoints(address):
    assert not is_endpoint(address)


def test_not_a_string():
    assert not is_endpoint(5555)  # type: ignore[arg-type]  # decoded from a peer: any type may come


@pytest.mark.parametrize("address", ["inproc://prefill-0", "tcp://127.0.0.1:0"])
def test_decode_worker_refuses_a_prefill_address_the_router_would(address):
    ctx = zmq.Context()
    peers = PrefillPeers(ctx, zmq.Poller(), "decode-0", 5.0, "tcp", DeploymentKey(new_secret()))
    try:
        with pytest.raises(HandshakeError, match="not a ZeroMQ endpoint"):
            peers.connect(address, KVHandshake("decode-0", "tcp://127.0.0.1:1", None, "tcp"))  # refused before it is sent
        assert not peers.peers
    finally:
        peers.close()
        ctx.term()
