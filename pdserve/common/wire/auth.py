"""Authenticated internal frames: every message between the router, workers and transfer
peers of one deployment carries an HMAC-SHA256 tag under the deployment's secret.

An authenticated message's first frame is

    MAGIC(4) | sender(8) | counter(8, big-endian) | time_ms(8, big-endian) | mac(32) | payload

mac = HMAC-SHA256(key, MAGIC | sender | counter | time_ms | len+payload | len+frame...):
it covers the payload and every raw frame after it (tcp KV data). `sender` is random per
Signer (one per socket), `counter` rises by one per message. A Verifier accepts a frame
only if its mac is right, its time is within `window_s` of the receiver's clock, and its
counter is above the last one accepted from that sender -- so a captured frame replayed
to the same receiver is refused, and one replayed after the window is refused anywhere.
The secret never travels: the launcher writes it into each worker's config file (0600).
"""
from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import struct
import threading
import time
from pathlib import Path

import zmq

from pdserve.common.wire.curve import FRONTEND_LABEL, CurveKeys

MAGIC = b"PDA1"
_HEADER = struct.Struct(">4s8sQQ")  # magic, sender, counter, time_ms
_MAC_LEN = 32
OVERHEAD = _HEADER.size + _MAC_LEN
SECRET_BYTES = 32
DEFAULT_WINDOW_S = 60.0  # clock skew + queueing a frame may show; multi-host clocks must agree to this


class AuthError(ValueError):
    """A frame is not authentic: no tag, a wrong tag, a stale time or a replayed counter."""


def new_secret() -> str:
    """A fresh deployment secret, hex (what `pdserve serve` writes into worker configs)."""
    return secrets.token_hex(SECRET_BYTES)


def parse_secret(text: str) -> bytes:
    """The key bytes of a hex secret; ValueError with a message a user can act on."""
    text = text.strip()
    try:
        key = bytes.fromhex(text)
    except ValueError:
        raise ValueError("a deployment secret must be hex (e.g. from `python -c 'import secrets; "
                         "print(secrets.token_hex(32))'`)") from None
    if len(key) < 16:
        raise ValueError(f"a deployment secret must be at least 16 bytes (32 hex digits), got {len(key)}")
    return key


def read_secret_file(path: str | Path) -> str:
    """A secret from a file only its owner can read (`--secret-file`, multi-host)."""
    path = Path(path)
    try:
        mode = path.stat().st_mode
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"cannot read secret file {path}: {e.strerror}") from None
    if mode & 0o077:
        raise ValueError(f"secret file {path} is readable by others (mode {mode & 0o777:o}); chmod 600 it")
    parse_secret(text)
    return text.strip()


class DeploymentKey:
    """The deployment's secret as keys: the MAC key, names derived from it and, when the
    deployment encrypts (`curve`), the CurveZMQ server keypair every socket of it uses."""

    def __init__(self, secret: str, curve: bool = False) -> None:
        self._key = parse_secret(secret)
        # names other processes can compute but not choose (shm segments)
        self.deployment_id = hmac.new(self._key, b"pdserve deployment id", hashlib.sha256).hexdigest()[:16]
        self.curve = CurveKeys.derive(self._key) if curve else None

    def curve_server(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it binds) a Curve server when the deployment encrypts."""
        if self.curve is not None:
            self.curve.serve(sock)

    def curve_client(self, sock: zmq.Socket) -> None:
        """Make `sock` (before it connects) a Curve client when the deployment encrypts."""
        if self.curve is not None:
            self.curve.connect(sock)

    def frontend_curve(self) -> CurveKeys:
        """The client ZeroMQ socket's Curve keypair (`--zmq-curve`): its public key is given
        to clients, who hold no secret; derived apart from the internal one."""
        return CurveKeys.derive(self._key, FRONTEND_LABEL)

    def signer(self) -> "Signer":
        return Signer(self._key)

    def verifier(self, window_s: float = DEFAULT_WINDOW_S) -> "Verifier":
        return Verifier(self._key, window_s)

    def __repr__(self) -> str:
        return f"DeploymentKey(id={self.deployment_id}, curve={self.curve is not None})"  # never the secret


def _mac(key: bytes, header: bytes, payload: bytes, frames: list) -> bytes:
    h = hmac.new(key, header, hashlib.sha256)
    for part in (payload, *frames):
        view = memoryview(part)
        h.update(struct.pack(">Q", view.nbytes))
        h.update(view)
    return h.digest()


class Signer:
    """Tags outgoing messages of one socket: a random sender id and a rising counter.
    Thread-safe (a counter must never repeat)."""

    def __init__(self, key: bytes) -> None:
        self._key = key
        self.sender = os.urandom(8)
        self._counter = 0
        self._lock = threading.Lock()

    def sign(self, payload: bytes, frames: list = ()) -> bytes:
        """The authenticated first frame for `payload` (and the raw `frames` after it)."""
        with self._lock:
            self._counter += 1
            counter = self._counter
        header = _HEADER.pack(MAGIC, self.sender, counter, int(time.time() * 1000))
        return header + _mac(self._key, header, payload, list(frames)) + payload


class Verifier:
    """Checks incoming frames of one receiving socket; owns the replay table (sender ->
    last counter accepted), pruned of senders silent for longer than the window."""

    def __init__(self, key: bytes, window_s: float = DEFAULT_WINDOW_S) -> None:
        self._key = key
        self.window_s = window_s
        self._last: dict[bytes, tuple[int, float]] = {}  # sender -> (counter, time seen)
        self._lock = threading.Lock()
        self._pruned = time.monotonic()

    def verify(self, first: bytes | memoryview, frames: list = ()) -> bytes:
        """The payload of an authentic first frame; AuthError says why not."""
        first = bytes(first)
        if len(first) < OVERHEAD or not first.startswith(MAGIC):
            raise AuthError("message is not authenticated (no deployment tag)")
        header, mac, payload = first[:_HEADER.size], first[_HEADER.size:OVERHEAD], first[OVERHEAD:]
        _, sender, counter, time_ms = _HEADER.unpack(header)
        if not hmac.compare_digest(mac, _mac(self._key, header, payload, list(frames))):
            raise AuthError("message tag does not verify (wrong deployment secret or altered frame)")
        skew = abs(time.time() - time_ms / 1000)
        if skew > self.window_s:
            raise AuthError(f"message is {skew:.0f} s off this clock (window {self.window_s:.0f} s): stale or replayed")
        now = time.monotonic()
        with self._lock:
            last = self._last.get(sender)
            if last is not None and counter <= last[0]:
                raise AuthError(f"replayed message (counter {counter} from sender {sender.hex()} "
                                f"already past {last[0]})")
            self._last[sender] = (counter, now)
            if now - self._pruned > self.window_s:
                # a sender silent past the window: any frame of its would fail the time check anyway
                self._last = {s: v for s, v in self._last.items() if now - v[1] <= 2 * self.window_s}
                self._pruned = now
        return payload
