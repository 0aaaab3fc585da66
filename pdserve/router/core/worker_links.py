"""The router's links to its workers: hellos and heartbeats on the control socket (the
registration check, then the registry), a socket per decode or colocated worker and the
loop that hands its outputs to the requests waiting for them, and liveness -- a worker
whose connection closes is suspected at once (no new requests until it is heard again,
router/core/availability.py), a worker silent past `stale_after_s` or whose process
exited is dead, and every request that still needs it is told so (router/core/router.py
re-routes it: router/core/recovery.py). A hello or heartbeat wakes the requests held for
a worker (router/core/hold.py).

`WorkerLinks` is a part of `Router` (router/core/router.py), which owns the state it reads: the
registry, the sockets, the requests in flight, the clock and the deployment's key."""
from __future__ import annotations

import asyncio
import sys

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.common.wire import messages
from pdserve.common.wire.auth import AuthError
from pdserve.common.wire.messages import (ChangeRole, DrainWorker, ErrorReply, MessageError, PoolsRequest, ScalePool,
                                  StepOutputs, WorkerHello, WorkerStatus)
from pdserve.common.wire.transport import is_endpoint
from pdserve.router.core.registry import WorkerEntry, refusal


class WorkerLinks:
    """The worker side of the Router: registration, a socket and receive loop per decode or
    colocated worker, and the death of a worker (silent or exited) with what its requests
    are told. Mixed into `Router`, whose constructor makes every attribute used here."""

    async def _control_loop(self) -> None:
        """Hellos and heartbeats. No message can end this loop: each is handled inside its
        own try, and what fails is logged and dropped."""
        while True:
            parts = await self.control.recv_multipart()
            try:
                self._on_control(parts)
            except Exception as e:  # a bug or an input nothing checked: log it, keep serving
                print(f"router: control message dropped: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def _on_control(self, parts: list[bytes]) -> None:
        if len(parts) != 2:
            print(f"router: dropped a control message of {len(parts)} frame(s), expected 2", file=sys.stderr, flush=True)
            return
        try:
            msg = messages.decode(self._control_auth.open(parts[1]))
        except AuthError:
            return  # logged by the authenticator
        except MessageError as e:
            print(f"router: dropped a malformed control message: {e}", file=sys.stderr, flush=True)
            return
        now = self.clock.monotonic()
        if isinstance(msg, WorkerHello):
            why = refusal(msg, self.config.block_size, self.model_fingerprint)
            if why is None and not is_endpoint(msg.address):  # connected to (D) or handed to D (P)
                why = f"refused worker {msg.worker_id!r}: address {msg.address!r} is not a ZeroMQ endpoint"
            if why is not None:
                print(f"router: {why}", file=sys.stderr, flush=True)
                return
            if self.registry.ignores(msg, now):
                return  # a retired worker's late hello
            if msg.role in ("decode", "colocated") and self._worker_addr.get(msg.worker_id) != msg.address:
                self._connect_worker(msg)  # new, or restarted at a new address
            self.registry.hello(msg, now)
            self.waits.changed()
        elif isinstance(msg, WorkerStatus):
            entry = self.registry.heartbeat(msg, now)
            if entry:
                self.metrics.worker_status(msg)
                self.waits.changed()
        elif isinstance(msg, (PoolsRequest, ScalePool, DrainWorker, ChangeRole)) and self.control_api is not None:
            self.control_api(parts[0], msg)
        else:
            print(f"router: dropped a {msg.TYPE!r} message on the control socket", file=sys.stderr, flush=True)

    def _connect_worker(self, hello: WorkerHello) -> None:
        """Connect to a decode/colocated worker; zmq.ZMQError (left as it was) if its
        address cannot be connected to."""
        wid = hello.worker_id
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self.key.curve_client(sock)
        try:
            sock.connect(hello.address)
        except zmq.ZMQError:
            sock.close(0)
            raise
        self.disconnect_worker(wid)
        self.worker_socks[wid] = sock
        self._worker_addr[wid] = hello.address
        self._worker_tasks[wid] = asyncio.create_task(self._worker_loop(wid, sock))
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._watches[wid] = (monitor, asyncio.create_task(self._watch_connection(wid, hello.address, monitor)))

    def disconnect_worker(self, worker_id: str) -> None:
        """Close the socket to a decode/colocated worker (a retired or restarted one)."""
        if (task := self._worker_tasks.pop(worker_id, None)) is not None:
            task.cancel()
            monitor, watch = self._watches.pop(worker_id)
            watch.cancel()
            sock = self.worker_socks.pop(worker_id)
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)
            self._worker_addr.pop(worker_id, None)

    async def _watch_connection(self, worker_id: str, address: str, monitor: zmq.asyncio.Socket) -> None:
        """Suspect the worker at `address` whenever its connection closes (its process died,
        its host went away, or the network did): it gets no new requests from that moment
        until it is heard again. Runs until cancelled (`disconnect_worker`, `close` close
        the monitor socket)."""
        while True:
            parse_monitor_message(await monitor.recv_multipart())
            entry = self.registry.workers.get(worker_id)
            if entry is not None and entry.hello.address == address and \
                    self.registry.suspect(entry, "its connection closed"):
                print(f"router: {entry.role} worker {worker_id} suspected: its connection closed",
                      file=sys.stderr, flush=True)

    def reply_control(self, identity: bytes, msg: object) -> None:
        """Answer a control-socket peer (signed with the deployment secret)."""
        self.control.send_multipart([identity, self._control_auth.seal(msg)])

    def seal(self, msg: object) -> bytes:
        """`msg` as a frame for a worker's server socket."""
        return self._worker_auth.seal(msg)

    async def _worker_loop(self, worker_id: str, sock: zmq.asyncio.Socket) -> None:
        while True:
            parts = await sock.recv_multipart()
            try:
                msg = messages.decode(self._worker_auth.open(parts[0], parts[1:]))
            except AuthError:
                continue  # logged by the authenticator
            except MessageError as e:
                print(f"[router] malformed message from worker {worker_id} dropped: {e}", file=sys.stderr, flush=True)
                continue
            if isinstance(msg, StepOutputs):
                for entry in msg.outputs:
                    if entry.num_draft_tokens:
                        self.metrics.spec_decode(entry.num_draft_tokens, entry.num_accepted_tokens)
                    req = self._by_wire.get(entry.request_id)
                    if req is not None:  # else: a request already ended here (a stop string, an abort)
                        req.queue.put_nowait(entry)
            elif isinstance(msg, ErrorReply):
                req = self._by_wire.get(msg.request_id)
                if req is not None:
                    req.queue.put_nowait(msg)
            else:
                print(f"[router] a {msg.TYPE!r} message from worker {worker_id} dropped", file=sys.stderr, flush=True)

    async def _expire_loop(self) -> None:
        while True:
            await self.clock.sleep_async(self.config.stale_after_s / 4)
            for dead in self.registry.expire(self.clock.monotonic()):
                self._worker_dead(dead, "stopped responding", "silent")

    def worker_exited(self, worker_id: str, why: str) -> None:
        """The launcher saw the worker's process exit: out of rotation now, not after
        `stale_after_s` of silence."""
        entry = self.registry.workers.get(worker_id)
        if entry is not None and self.registry.mark_dead(entry):
            self._worker_dead(entry, why, "exited")

    def _worker_dead(self, dead: WorkerEntry, why: str, how: str) -> None:
        """Every request that still needs `dead` gets a worker_failed error on its queue;
        `generate` re-routes it (router/core/recovery.py)."""
        print(f"router: {dead.role} worker {dead.worker_id} {why}", file=sys.stderr, flush=True)
        self.metrics.worker_deaths.labels(how).inc()
        self.metrics.forget_worker(dead.worker_id, dead.role)
        for req in list(self.inflight.values()):
            if req.decode is dead or (req.prefill is dead and req.first_token_at is None):
                req.queue.put_nowait(ErrorReply(req.wire_id, f"{dead.role} worker {dead.worker_id} {why}",
                                                "worker_failed"))

    async def wait_for_workers(self, prefill: int, decode: int, colocated: int, timeout: float = 120.0) -> None:
        deadline = self.clock.monotonic() + timeout
        while True:
            have = {r: len(self.registry.live((r,))) for r in ("prefill", "decode", "colocated")}
            if have["prefill"] >= prefill and have["decode"] >= decode and have["colocated"] >= colocated:
                return
            if self.clock.monotonic() > deadline:
                raise TimeoutError(f"workers not registered after {timeout:.0f} s: have {have}")
            await self.clock.sleep_async(0.05)
