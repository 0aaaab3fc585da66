"""CurveZMQ on the internal sockets: encryption of everything that may leave a host.

Every process that holds the deployment secret derives the same long-term server keypair
from it (HMAC-SHA256(secret, label) is the Curve25519 secret key), so no key is ever
distributed beyond the secret itself. A socket that binds (router control socket, a
worker's server socket, which carries the tcp KV frames) is a Curve server with that
keypair; a socket that connects is a Curve client with a fresh ephemeral keypair and the
derived server public key. What this gives:

- confidentiality and integrity of every frame (Curve's per-connection session keys);
- the server is authenticated: a peer without the secret cannot derive the server's
  secret key, so it can neither answer a client's handshake nor read its frames;
- a client without the secret does not know the server's public key, so its handshake
  fails (HANDSHAKE_FAILED on both sides, before any message). Clients are not
  authenticated by Curve itself: the HMAC on every message (common.wire.auth) stays the
  check of who sent what, as it is without Curve.

Which deployments use it is one setting, the same on every process of a deployment
(`resolve`): a Curve socket and a plain one cannot talk to each other.
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
import sys
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

MODES = ("auto", "on", "off")
_LABEL = b"pdserve curve server key v1"
FRONTEND_LABEL = b"pdserve curve client front end key v1"  # the client ZeroMQ socket's own keypair
_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.EVENT_HANDSHAKE_FAILED_AUTH}
FAILURES_TO_GIVE_UP = 3  # failed handshakes in a row that mean "another deployment" (libzmq retries every 0.1 s)
_HOST = re.compile(r"^tcp://\[?([^\]]*?)\]?:\d+$")


def require_curve() -> None:
    """Raise RuntimeError, saying what to do, if this libzmq was built without Curve."""
    if not zmq.has("curve"):
        raise RuntimeError(f"CurveZMQ is not available in this libzmq ({zmq.zmq_version()}, pyzmq {zmq.__version__}): "
                           f"install pyzmq's wheel (bundles libzmq with Curve), or run with --curve off on a "
                           f"network no one else can read")


def is_loopback(address: str) -> bool:
    """Whether a ZeroMQ endpoint (or a bare host) stays on this host: loopback, ipc, inproc.
    A name (not an IP) counts as leaving the host: it may resolve to any address."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    m = _HOST.match(address)
    host = m.group(1) if m else address
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def resolve(mode: str, addresses: list[str], shared_secret: bool) -> bool:
    """Whether a deployment encrypts: `on`/`off` as asked; `auto` is on when the secret is
    shared between hosts (given as a file: `pdserve router`, `pdserve worker --join`,
    `serve --secret-file`) or any address binds beyond loopback, off when everything is
    this host's loopback with a secret made for this one run."""
    if mode not in MODES:
        raise ValueError(f"curve must be one of {', '.join(MODES)}, got {mode!r}")
    if mode == "auto":
        return shared_secret or not all(is_loopback(a) for a in addresses)
    return mode == "on"


@dataclass(frozen=True)
class CurveKeys:
    """The deployment's Curve server keypair (Z85), derived from the secret."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def derive(cls, key: bytes, label: bytes = _LABEL) -> "CurveKeys":
        require_curve()
        secret = z85.encode(hmac.new(key, label, hashlib.sha256).digest())  # any 32 bytes are a valid key
        return cls(zmq.curve_public(secret), secret)

    def serve(self, sock: zmq.Socket) -> None:
        """Make `sock` a Curve server (before it binds)."""
        sock.curve_secretkey = self.secret
        sock.curve_publickey = self.public
        sock.curve_server = True

    def connect(self, sock: zmq.Socket) -> None:
        """Make `sock` a Curve client of the deployment's servers (before it connects)."""
        connect_to(sock, self.public)


def connect_to(sock: zmq.Socket, server_public: bytes) -> None:
    """Make `sock` (before it connects) a Curve client, with a fresh keypair, of the server
    whose public key (Z85) is `server_public`."""
    require_curve()
    public, secret = zmq.curve_keypair()
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


class HandshakeWatch:
    """Watches one socket's ZeroMQ handshakes: a peer whose Curve handshake fails holds
    another secret (or the other --curve setting) -- libzmq drops it without a message.
    It also follows the connection: `connected` (a handshake succeeded and the connection
    has not closed since) and `handshakes` (how many have succeeded: each is a new
    connection, to a peer that may have restarted)."""

    def __init__(self, sock: zmq.Socket) -> None:
        self.sock = sock
        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | sum(_FAILED))
        self.failures = 0  # in a row, since the last handshake that succeeded
        self.mismatch = False  # the peer runs the other --curve setting (libzmq does not retry then)
        self.connected = False
        self.handshakes = 0
        self._why = ""

    def poll(self) -> str | None:
        """Read the events waiting (never blocks): why the peer is surely not one of this
        deployment's -- the other --curve setting, or FAILURES_TO_GIVE_UP failed handshakes
        in a row (one alone may be a peer dying mid-handshake) -- else None."""
        while self.monitor.poll(0):
            event, value = _event(self.monitor.recv_multipart())
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.failures = 0
                self.connected = True
                self.handshakes += 1
            elif event == zmq.EVENT_DISCONNECTED:
                self.connected = False
            elif event in _FAILED:
                self.failures += 1
                self.mismatch = self.mismatch or value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH
                self._why = handshake_failure(event, value)
        return self._why if self.mismatch or self.failures >= FAILURES_TO_GIVE_UP else None

    def close(self) -> None:
        """Stop monitoring, then close the reading end (before the socket closes)."""
        if not self.sock.closed:
            self.sock.disable_monitor()
        self.monitor.close(0)


def _event(parts: list[bytes]) -> tuple[int, int]:
    msg = parse_monitor_message(parts)
    return msg["event"], msg["value"]


def handshake_failure(event: int, value: int) -> str:
    """What a failed handshake most likely means, in words a user can act on."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return "the peer's --curve setting differs from this one's (one side encrypts, the other does not)"
    if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "the CurveZMQ handshake failed: the peer holds another deployment secret"
    return ("the CurveZMQ handshake failed: the peer holds another deployment secret, or its --curve setting "
            "differs from this one's")


async def log_handshake_failures(sock: zmq.Socket, where: str) -> None:
    """Log (at most one line a second, with a running count) each failed handshake on an
    asyncio socket: a process without the secret trying to connect. Runs until cancelled."""
    monitor = sock.get_monitor_socket(sum(_FAILED))
    failures, logged = 0, 0.0
    try:
        while True:
            event, value = _event(await monitor.recv_multipart())
            failures += 1
            if time.monotonic() - logged >= 1.0:
                logged = time.monotonic()
                print(f"{where}: refused a connection ({failures} so far): {handshake_failure(event, value)}",
                      file=sys.stderr, flush=True)
    finally:
        if not sock.closed:
            sock.disable_monitor()
        monitor.close(0)
