"""common/wire/curve.py on loopback: the server keypair every holder of the secret derives,
when a deployment encrypts, and what a listener between two internal sockets sees --
ciphertext with Curve, the messages themselves without it (so the check can fail)."""
from __future__ import annotations

import time

import pytest
import zmq

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire import curve
from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.wire.messages import GenerateRequest
from pdserve.common.wire.transport import Client, Server
from tests.support.wire_tap import WireTap

MARKER = b"plaintext KV marker " * 64  # a raw frame, as the tcp KV transport sends one
PROMPT = [9707, 1879, 11, 4337, 31337]


def test_every_holder_of_the_secret_derives_the_same_server_keys():
    secret = new_secret()
    a, b = DeploymentKey(secret, curve=True).curve, DeploymentKey(secret, curve=True).curve
    assert a == b and len(a.public) == len(a.secret) == 40  # Z85 of 32 bytes
    assert zmq.curve_public(a.secret) == a.public
    assert DeploymentKey(new_secret(), curve=True).curve.public != a.public
    assert DeploymentKey(secret).curve is None
    assert secret not in repr(DeploymentKey(secret, curve=True)) and a.secret.decode() not in repr(a)


@pytest.mark.parametrize("mode, addresses, shared, want", [
    ("auto", ["tcp://127.0.0.1:5"], False, False),  # `pdserve serve` on one host
    ("auto", ["tcp://127.0.0.1:5"], True, True),  # a secret from a file: hosts share it
    ("auto", ["tcp://10.0.0.2:5"], False, True),
    ("auto", ["tcp://0.0.0.0:5"], False, True),
    ("auto", ["tcp://[::1]:5", "ipc:///tmp/x", "tcp://localhost:5"], False, False),
    ("auto", ["tcp://node-3:5"], False, True),  # a name may resolve anywhere
    ("on", ["tcp://127.0.0.1:5"], False, True),
    ("off", ["tcp://10.0.0.2:5"], True, False),
])
def test_when_a_deployment_encrypts(mode, addresses, shared, want):
    assert curve.resolve(mode, addresses, shared) is want


def test_a_bad_mode_is_refused():
    with pytest.raises(ValueError, match="curve must be one of auto, on, off"):
        curve.resolve("yes", [], False)


def test_a_libzmq_without_curve_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(zmq, "has", lambda capability: capability != "curve")
    with pytest.raises(RuntimeError, match="CurveZMQ is not available.*--curve off"):
        DeploymentKey(new_secret(), curve=True)


def _exchange(server_key: DeploymentKey, client_key: DeploymentKey) -> tuple[bytes, GenerateRequest | None]:
    """One GenerateRequest plus a raw frame from a Client to a Server through a wire tap:
    (bytes the tap saw, the message the server got or None)."""
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0", key=server_key)
    tap = WireTap(("127.0.0.1", int(server.address.rsplit(":", 1)[1])))
    client = Client(ctx, tap.address, key=client_key)
    try:
        client.send(GenerateRequest("req-1", PROMPT, SamplingParams(max_tokens=4)), [MARKER])
        got = None
        if server.sock.poll(3000):
            inc = server.recv()
            got = inc.msg if inc is not None and bytes(inc.frames[0]) == MARKER else None
        return tap.bytes_seen(), got
    finally:
        client.close()
        server.close()
        ctx.term()
        tap.close()


def test_with_curve_a_listener_sees_only_ciphertext():
    key = DeploymentKey(new_secret(), curve=True)
    seen, got = _exchange(key, key)
    assert got is not None and got.prompt_token_ids == PROMPT
    assert len(seen) > len(MARKER)  # the frame went through the tap
    for plain in (MARKER[:20], b"prompt_token_ids", b"generate", b"PDA1"):
        assert plain not in seen


def test_without_curve_the_same_listener_reads_everything():
    key = DeploymentKey(new_secret())
    seen, got = _exchange(key, key)
    assert got is not None
    for plain in (MARKER[:20], b"prompt_token_ids", b"generate", b"PDA1"):
        assert plain in seen


def _failed_handshake(client_key: DeploymentKey, server_key: DeploymentKey) -> str | None:
    """Connect and send once; what the client's HandshakeWatch reports within 3 s."""
    ctx = zmq.Context()
    server = Server(ctx, "tcp://127.0.0.1:0", key=server_key)
    client = Client(ctx, server.address, key=client_key, watch_handshakes=True)
    watch = client.handshakes
    try:  # never a blocking send: after a mechanism mismatch libzmq drops the pipe for good
        client.send_or_drop(GenerateRequest("req-1", PROMPT, SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 3
        while time.monotonic() < deadline:
            why = watch.poll()
            if why is not None:
                assert not server.sock.poll(100)  # nothing reached the server
                return why
            time.sleep(0.05)
        return None
    finally:
        client.close()
        server.close()
        ctx.term()


def test_a_client_without_the_secret_fails_the_handshake():
    why = _failed_handshake(DeploymentKey(new_secret(), curve=True), DeploymentKey(new_secret(), curve=True))
    assert why is not None and "another deployment secret" in why


def test_a_curve_setting_that_differs_is_named():
    secret = new_secret()
    why = _failed_handshake(DeploymentKey(secret), DeploymentKey(secret, curve=True))
    assert why is not None and "--curve setting differs" in why


def test_the_same_secret_raises_no_alarm():
    key = DeploymentKey(new_secret(), curve=True)
    assert _failed_handshake(key, key) is None
