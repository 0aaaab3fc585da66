"""Typed ZeroMQ endpoints: every send encodes a declared message (plus optional raw
frames) and every receive decodes one, so no ad-hoc dicts reach a socket."""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import zmq

from common import messages
from common.messages import ErrorReply, MessageError


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

    def __init__(self, ctx: zmq.Context, address: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.address = bind_address(self.sock, address)

    def recv(self) -> Incoming | None:
        parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
        identity, body = parts[0], parts[1:]
        if not body:
            return None
        try:
            msg = messages.decode(body[0])
        except MessageError as e:
            self.send(identity, ErrorReply(request_id="", message=str(e), code="malformed"))
            return None
        return Incoming(identity, msg, body[1:])

    def send(self, identity: bytes, msg: Any, frames: list = ()) -> None:
        self.sock.send_multipart([identity, messages.encode(msg), *frames], copy=False)

    def close(self) -> None:
        self.sock.close(0)


class Client:
    """A DEALER socket connected to one Server."""

    def __init__(self, ctx: zmq.Context, address: str, identity: bytes | None = None) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity:
            self.sock.setsockopt(zmq.IDENTITY, identity)
        try:
            self.sock.connect(address)
        except zmq.ZMQError:
            self.sock.close(0)  # an open socket would make Context.term() hang
            raise
        self.address = address

    def send(self, msg: Any, frames: list = ()) -> None:
        self.sock.send_multipart([messages.encode(msg), *frames], copy=False)

    def recv(self, timeout_ms: int | None = None) -> Incoming:
        """Block for one message (TimeoutError after timeout_ms); MessageError if malformed."""
        if timeout_ms is not None and not self.sock.poll(timeout_ms):
            raise TimeoutError(f"no reply from {self.address} within {timeout_ms} ms")
        parts = self.sock.recv_multipart()
        return Incoming(None, messages.decode(parts[0]), parts[1:])

    def recv_nowait(self) -> Incoming | None:
        """One message if one is waiting; raw frames come as zero-copy memoryviews."""
        try:
            parts = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            return Incoming(None, messages.decode(parts[0].bytes), [f.buffer for f in parts[1:]])
        except MessageError as e:  # a peer's bug or a forgery: say so, keep the connection
            print(f"[pid {os.getpid()}] malformed message from {self.address} dropped: {e}",
                  file=sys.stderr, flush=True)
            return None

    def close(self) -> None:
        self.sock.close(0)
