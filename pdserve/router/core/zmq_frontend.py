"""The client-facing ZeroMQ socket (ROUTER): msgpack SubmitRequest / AbortRequest in,
TokenOutput stream / ErrorReply out, as documented in docs/protocol.md."""
from __future__ import annotations

import asyncio
import dataclasses

import zmq
import zmq.asyncio

from pdserve.common.wire import messages
from pdserve.common.wire.messages import AbortRequest, ClientHeartbeat, ErrorReply, MessageError, SubmitRequest
from pdserve.common.wire.transport import bind_address
from pdserve.router.core.router import Router
from pdserve.router.core.text import merge_outputs

MAX_FRAME_BYTES = 64 * 1024 * 1024  # hard cap enforced by libzmq; above decode()'s 16 MiB error reply


class ZmqFrontend:
    """Owns the client socket and one task per request being streamed."""

    def __init__(self, router: Router, address: str) -> None:
        self.router = router
        self.sock = router.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.server_key = None  # Z85 public key clients pin with --zmq-curve, else plain
        if router.config.zmq_curve:
            keys = router.key.frontend_curve()
            keys.serve(self.sock)
            self.server_key = keys.public.decode()
        self.address = bind_address(self.sock, address)
        self._streams: dict[tuple[bytes, str], asyncio.Task] = {}
        self._task: asyncio.Task | None = None
        # clients that heartbeat (docs/protocol.md): identity -> last message (monotonic s)
        self._heartbeating: dict[bytes, float] = {}
        self._reaper: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())
        self._reaper = asyncio.create_task(self._reap_silent())

    async def _reap_silent(self) -> None:
        """A ROUTER socket does not report a client that went away: a client that has
        heartbeated and then is silent past client_timeout_s is gone; its streams are
        cancelled, which aborts their requests on the workers (Router.generate)."""
        limit = self.router.config.client_timeout_s
        while True:
            await self.router.clock.sleep_async(min(1.0, limit / 4))
            now = self.router.clock.monotonic()
            for identity, seen in list(self._heartbeating.items()):
                if now - seen <= limit:
                    continue
                del self._heartbeating[identity]
                for (ident, _), task in list(self._streams.items()):
                    if ident == identity:
                        task.cancel()

    async def _send(self, identity: bytes, msg) -> None:
        await self.sock.send_multipart([identity, messages.encode(msg)])

    async def _loop(self) -> None:
        while True:
            parts = await self.sock.recv_multipart()
            identity = parts[0]
            if len(parts) != 2:
                await self._send(identity, ErrorReply("", "a request is exactly one msgpack frame", "malformed"))
                continue
            try:
                msg = messages.decode(parts[1])
            except MessageError as e:
                await self._send(identity, ErrorReply("", str(e), "malformed"))
                continue
            if identity in self._heartbeating or isinstance(msg, ClientHeartbeat):
                self._heartbeating[identity] = self.router.clock.monotonic()
            if isinstance(msg, ClientHeartbeat):
                continue
            if isinstance(msg, SubmitRequest):
                key = (identity, msg.request_id)
                if key in self._streams:
                    await self._send(identity, ErrorReply(msg.request_id, "request id already in flight"))
                    continue
                self._streams[key] = asyncio.create_task(self._stream(identity, msg))
            elif isinstance(msg, AbortRequest):
                task = self._streams.get((identity, msg.request_id))
                if task:
                    task.cancel()
            else:
                await self._send(identity, ErrorReply(getattr(msg, "request_id", ""),
                                                      f"clients may send 'submit' or 'abort', not {msg.TYPE!r}"))

    async def _stream(self, identity: bytes, sub: SubmitRequest) -> None:
        # clients pick their own ids: qualify them by connection so two clients cannot collide
        internal = dataclasses.replace(sub, request_id=f"{identity.hex()}/{sub.request_id}")
        try:
            pending: dict[int, list] = {}  # choice -> its outputs so far
            async for out in self.router.generate(internal):
                out.request_id = sub.request_id
                if sub.stream or isinstance(out, ErrorReply):
                    await self._send(identity, out)
                    continue
                pending.setdefault(out.index, []).append(out)  # non-streaming: one final message per choice
                if out.finished:
                    await self._send(identity, merge_outputs(pending.pop(out.index)))
        except asyncio.CancelledError:
            await self._send(identity, ErrorReply(sub.request_id, "aborted by client", "aborted"))
        finally:
            self._streams.pop((identity, sub.request_id), None)

    def close(self) -> None:
        for t in (self._task, self._reaper):
            if t is not None:
                t.cancel()
        for t in self._streams.values():
            t.cancel()
        self.sock.close(0)
