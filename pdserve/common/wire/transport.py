"""Typed ZeroMQ endpoints: every send encodes a declared message (plus optional raw
frames) and every receive decodes one, so no ad-hoc dicts reach a socket. Internal
endpoints (given the deployment's key) sign every message they send and drop, with a log
line, every message that is not authentic (common.wire.auth), and are CurveZMQ servers or
clients when the deployment encrypts (common.wire.curve); the public front end has none."""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Any

import zmq

from pdserve.common.wire import messages
from pdserve.common.wire.auth import AuthError, DeploymentKey
from pdserve.common.wire.curve import HandshakeWatch
from pdserve.common.wire.messages import ErrorReply, MessageError


class Authenticator:
    """One socket's signer and verifier (None: an unauthenticated, public socket), and the
    rate-limited log of what it refused."""

    def __init__(self, key: DeploymentKey | None, where: str) -> None:
        self.signer = key.signer() if key else None
        self.verifier = key.verifier() if key else None
        self.where = where
        self.refused = 0
        self._logged_at = 0.0

    def seal(self, msg: Any, frames: list | tuple = ()) -> bytes:
        payload = messages.encode(msg)
        return self.signer.sign(payload, list(frames)) if self.signer else payload

    def open(self, first: bytes | memoryview, frames: list | tuple = ()) -> bytes:
        """The payload of an authentic frame; AuthError (logged here) if it is not."""
        if self.verifier is None:
            return bytes(first)
        try:
            return self.verifier.verify(first, list(frames))
        except AuthError as e:
            self.refused += 1
            now = time.monotonic()
            if now - self._logged_at >= 1.0:  # a flood of forgeries must not flood the log
                self._logged_at = now
                print(f"[pid {os.getpid()}] {self.where}: refused an unauthenticated message "
                      f"({self.refused} so far): {e}", file=sys.stderr, flush=True)
            raise


_ENDPOINT = re.compile(r"^(tcp://[^\s:/]+:\d{1,5}|tcp://\[[0-9a-fA-F:.]+\]:\d{1,5}|ipc://[^\s]+)$")


def is_endpoint(address: str) -> bool:
    """Whether a peer-supplied address is a ZeroMQ endpoint this side may connect to
    (tcp://host:port, or ipc://path). The one rule for every such address: the router's
    check of a worker's, and a decode worker's of a prefill peer's. inproc is refused:
    workers are other processes, and an inproc name would reach a socket inside this one."""
    return isinstance(address, str) and len(address) <= 1024 and bool(_ENDPOINT.match(address)) and \
        (not address.startswith("tcp://") or 0 < int(address.rsplit(":", 1)[1]) < 65536)


def bind_address(sock: zmq.Socket, address: str) -> str:
    """Bind and return the concrete endpoint (port 0 picks a free port)."""
    sock.bind(address)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


@dataclass
class Incoming:
    """One decoded message: who sent it (ROUTER identity, or None), it, and raw frames."""

    identity: bytes | None
    msg: Any
    frames: list[bytes]


class Server:
    """A ROUTER socket: requests come in with the sender's identity; replies go back to it.
    Malformed input is answered with an ErrorReply and never raises to the caller."""

    def __init__(self, ctx: zmq.Context, address: str, key: DeploymentKey | None = None) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if key is not None:
            key.curve_server(self.sock)
        self.address = bind_address(self.sock, address)
        self.auth = Authenticator(key, f"server {self.address}")

    def recv(self) -> Incoming | None:
        parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        identity, body = parts[0], parts[1:]
        if not body:
            return None
        try:
            payload = self.auth.open(body[0], body[1:])
        except AuthError:
            return None  # not from this deployment: no reply (it would be a signed frame)
        try:
            msg = messages.decode(payload)
        except MessageError as e:
            self.send(identity, ErrorReply(request_id="", message=str(e), code="malformed"))
            return None
        return Incoming(identity, msg, body[1:])

    def send(self, identity: bytes, msg: Any, frames: list = ()) -> None:
        self.sock.send_multipart([identity, self.auth.seal(msg, frames), *frames], copy=False)

    def close(self) -> None:
        self.sock.close(0)


class Client:
    """A DEALER socket connected to one Server; with `watch_handshakes`, the watch on its
    handshakes and connection (attached before it connects: a failed handshake is not
    retried); with `heartbeat` (interval s, timeout s), ZeroMQ pings the peer and closes a
    connection that stays silent past the timeout (a peer whose host died sends no reset),
    and gives up a connect attempt unanswered that long (then tries again)."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None = None,
                 key: DeploymentKey | None = None, watch_handshakes: bool = False,
                 heartbeat: tuple[float, float] | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if heartbeat is not None:
            self.sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(heartbeat[0] * 1000)))
            self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, max(1, int(heartbeat[1] * 1000)))
            # a connect to a host that drops packets waits out TCP's SYN backoff (minutes) otherwise
            self.sock.setsockopt(zmq.CONNECT_TIMEOUT, max(1, int(heartbeat[1] * 1000)))
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        if key is not None:
            key.curve_client(self.sock)
        self.handshakes = HandshakeWatch(self.sock) if watch_handshakes else None
        try:
            self.sock.connect(address)
        except zmq.ZMQError:
            self.close()  # an open socket would make Context.term() hang
            raise
        self.address = address
        self.auth = Authenticator(key, f"client of {address}")

    def send(self, msg: Any, frames: list = ()) -> None:
        self.sock.send_multipart([self.auth.seal(msg, frames), *frames], copy=False)

    def send_or_drop(self, msg: Any) -> bool:
        """Send unless the queue to an absent peer is full (False: dropped). For messages
        that are repeated anyway (heartbeats, hellos): a router away for minutes must not
        block the sender once its send queue holds SNDHWM of them."""
        try:
            self.sock.send_multipart([self.auth.seal(msg, ())], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def recv(self, timeout_ms: int | None = None) -> Incoming:
        """Block for one message (TimeoutError after timeout_ms); MessageError if
        malformed, AuthError if not authentic."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            raise TimeoutError(f"no reply from {self.address} within {timeout_ms} ms")
        parts = self.sock.recv_multipart()
        return Incoming(None, messages.decode(self.auth.open(parts[0], parts[1:])), parts[1:])

    def recv_nowait(self) -> Incoming | None:
        """One message if one is waiting; raw frames come as zero-copy memoryviews."""
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [f.buffer for f in parts[1:]]
        try:
            return Incoming(None, messages.decode(self.auth.open(parts[0].buffer, frames)), frames)
        except AuthError:
            return None  # logged by the authenticator
        except MessageError as e:  # a peer's bug or a forgery: say so, keep the connection
            print(f"[pid {os.getpid()}] malformed message from {self.address} dropped: {e}",
                  file=sys.stderr, flush=True)
            return None

    def close(self) -> None:
        if self.handshakes is not None:
            self.handshakes.close()
        self.sock.close(0)
