"""The router's pool control API: list the pools, grow or shrink one, drain one worker,
change a worker's role. Requests arrive on the router's control socket (signed with the
deployment secret like every internal message; anything else is refused unanswered) and
each gets one `ControlReply`. `pdserve scale` / `pdserve pools` are thin clients
(router/pools/client.py); docs/deploy.md "Growing and shrinking pools".

A removed worker drains: the router stops routing to it at once, waits until nothing
routed to it is left (a decode worker's requests finished, a prefill worker's hand-offs
delivered), then sends it `WorkerDrain`; the worker finishes what it holds and exits 0.
Workers are started by a `WorkerLauncher` (router/pools/launch.py) where the router has
one; without, the router accepts whoever joins and says how to start one.

Refused, changing nothing: an unknown worker id, shrinking a pool below zero, removing
workers so that none could serve a request (the last decode worker of a P/D deployment,
say: requests waiting for it would wait forever), growing a pool without a launcher, and
a role change of a worker the router did not start."""
from __future__ import annotations

import sys
from dataclasses import dataclass

import zmq

from pdserve.common.clock import Clock
from pdserve.common.wire.messages import (ChangeRole, ControlReply, DrainWorker, PoolsRequest, PoolWorker, ScalePool,
                                  WorkerDrain)
from pdserve.router.core.router import Router
from pdserve.router.pools.launch import WorkerLauncher
from pdserve.router.core.registry import DRAINING, EXITING, PoolError, WorkerEntry
from pdserve.router.core.background import Background

ROLES = ("prefill", "decode", "colocated")
TICK_S = 0.05  # how often drains are checked: bounds the delay between a drain's last request and the exit
EXIT_GRACE_S = 60.0  # a started worker told to exit and still running after this is stopped by its launcher
MAX_DEPARTED = 64  # departed workers `pools` remembers (the oldest are forgotten first)
MAX_SPAWN = 16  # workers started per request (a typo such as +100 must not fork a hundred processes)
PREFILL_SEND_LINGER_MS = 2000  # how long a one-off socket to a prefill worker may take to deliver WorkerDrain


@dataclass
class Departed:
    """A worker that left a pool, or never joined it (shown by `pools` until it is replaced
    or forgotten)."""

    worker_id: str
    role: str
    exit_code: int | None
    managed: bool
    routed: int = 0  # requests it was routed while in the pool
    reason: str = ""  # why its launcher gave up starting it (state "failed")


class ControlPlane(Background):
    """Owns the pool operations in progress: workers started and not yet registered, role
    changes waiting for their worker to exit, and the workers that left. The worker table
    itself is the router's registry (router/core/registry.py: serving -> draining -> exiting)."""

    def __init__(self, router: Router, launcher: WorkerLauncher | None = None, join_hint: str = "") -> None:
        self.router = router
        self.launcher = launcher
        self.join_hint = join_hint  # said when asked to grow a pool without a launcher
        self.starting: dict[str, tuple[str, float]] = {}  # worker id -> (role, when started)
        self.next_role: dict[str, tuple[str, dict]] = {}  # worker id -> (role, engine options) to restart it with
        self.departed: dict[str, Departed] = {}
        self._stopped: set[str] = set()  # exiting workers whose launcher was asked to stop them
        router.control_api = self.on_request

    @property
    def clock(self) -> Clock:
        return self.router.clock

    # ---- requests ------------------------------------------------------------------------
    def on_request(self, identity: bytes, msg: object) -> None:
        """Answer one control request; a refusal changes nothing."""
        try:
            if isinstance(msg, PoolsRequest):
                reply = self.reply(True, "pools")
            elif isinstance(msg, ScalePool):
                reply = self.scale(msg.role, msg.delta, msg.engine)
            elif isinstance(msg, DrainWorker):
                reply = self.drain([msg.worker_id])
            elif isinstance(msg, ChangeRole):
                reply = self.change_role(msg.worker_id, msg.role, msg.engine)
            else:
                raise PoolError(f"not a control request: {type(msg).__name__}")
        except PoolError as e:
            reply = self.reply(False, str(e))
        except Exception as e:  # a launcher that failed to start a process, a bug: the asker hears of it
            print(f"router: pool request {type(msg).__name__} failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            reply = self.reply(False, f"{type(msg).__name__} failed: {type(e).__name__}: {e}")
        self.router.reply_control(identity, reply)

    def scale(self, role: str, delta: int, engine: dict | None = None) -> ControlReply:
        _check_role(role)
        if delta > 0:
            return self.grow(role, delta, engine)
        if delta < 0:
            serving = sorted(self.router.registry.live((role,)), key=lambda e: (e.inflight, e.worker_id))
            if -delta > len(serving):
                raise PoolError(f"cannot remove {-delta} {role} worker(s): the {role} pool has {len(serving)} serving")
            return self.drain([e.worker_id for e in serving[:-delta]])
        return self.reply(True, f"{role} pool unchanged")

    def grow(self, role: str, count: int, engine: dict | None = None) -> ControlReply:
        if count > MAX_SPAWN:
            raise PoolError(f"at most {MAX_SPAWN} workers are started per request, asked for {count}")
        if self.launcher is None:
            raise PoolError(f"this router starts no workers: it accepts whoever joins. Start a {role} worker "
                            f"on any host with: {self.join_hint.replace('{role}', role)}")
        started = []
        for _ in range(count):
            wid = self.launcher.spawn(role, "", engine)
            self._starting(wid, role)
            started.append(wid)
        return self.reply(True, f"starting {count} {role} worker(s): {', '.join(started)}; each takes "
                                f"requests once it has registered", started)

    def drain(self, worker_ids: list[str]) -> ControlReply:
        reg = self.router.registry
        entries = [reg.serving_entry(w) for w in dict.fromkeys(worker_ids)]  # PoolError: unknown, not serving
        if not reg.can_serve_without(entries):
            raise PoolError(f"refused to drain {', '.join(worker_ids)}: no worker left could serve a request (a "
                            f"prefill and a decode worker, or a colocated one); add workers first")
        for entry in entries:
            reg.drain(entry, self.clock.monotonic())
        return self.reply(True, f"draining {', '.join(worker_ids)}: no new requests; each exits once its "
                                f"requests are done", worker_ids)

    def change_role(self, worker_id: str, role: str, engine: dict | None = None) -> ControlReply:
        _check_role(role)
        entry = self.router.registry.workers.get(worker_id)
        if entry is not None and entry.role == role:
            raise PoolError(f"worker {worker_id} is already a {role} worker")
        if entry is not None and not self._owns(worker_id):
            raise PoolError(f"worker {worker_id} joined on its own: the router cannot restart it. Drain it "
                            f"(pdserve scale --worker {worker_id} --drain) and start a {role} worker on its host")
        self.drain([worker_id])  # PoolError for an unknown one
        self.next_role[worker_id] = (role, {"device": entry.hello.device, **(engine or {})})
        return self.reply(True, f"draining {worker_id}; it restarts as a {role} worker once drained", [worker_id])

    def reply(self, ok: bool, message: str, worker_ids: list[str] | None = None) -> ControlReply:
        return ControlReply(ok, message, list(worker_ids or []), self.pools(), self.launcher is not None)

    def pools(self) -> list[PoolWorker]:
        """Every worker the router knows: registered, starting, and departed."""
        out = [PoolWorker(e.worker_id, e.role, e.state if e.alive else "dead", e.hello.address, e.inflight, e.routed,
                          self._owns(e.worker_id)) for e in self.router.registry.workers.values()]
        out += [PoolWorker(w, role, "starting", managed=True) for w, (role, _) in self.starting.items()
                if w not in self.router.registry.workers]
        out += [PoolWorker(d.worker_id, d.role, "failed" if d.reason else "exited", routed=d.routed, managed=d.managed,
                           exit_code=d.exit_code, reason=d.reason)
                for d in self.departed.values() if d.worker_id not in self.router.registry.workers]
        return sorted(out, key=lambda w: (ROLES.index(w.role) if w.role in ROLES else 9, w.worker_id))

    # ---- drains in progress -------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await self.clock.sleep_async(TICK_S)
            try:
                await self.tick()
            except Exception as e:  # a bug must not end the drains of every later request
                print(f"router: pool control: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    async def tick(self) -> None:
        """Tell drained workers to exit; retire exiting ones that fell silent (joined
        ones: a started one is retired when its launcher reports its exit, so its exit
        code is known and a restart under the same id never races the old process);
        stop started ones that ignore the request; forget starts that registered."""
        reg, now = self.router.registry, self.clock.monotonic()
        for w in [w for w in self.starting if w in reg.workers]:
            del self.starting[w]
        for entry in reg.ready_to_exit(now):
            print(f"router: {entry.role} worker {entry.worker_id} drained ({entry.routed} requests served): "
                  f"telling it to exit", file=sys.stderr, flush=True)
            await self._tell_exit(entry)
        for entry in reg.exited_silently(now):
            if not self._owns(entry.worker_id):  # a started one leaves when its launcher sees it exit
                self.retire(entry, None)
        for e in reg.workers.values():
            if e.state == EXITING and now - e.state_since > EXIT_GRACE_S and self._owns(e.worker_id) and \
                    e.worker_id not in self._stopped:
                self._stopped.add(e.worker_id)
                self.launcher.stop(e.worker_id)

    def _owns(self, worker_id: str) -> bool:
        return self.launcher is not None and self.launcher.owns(worker_id)

    async def _tell_exit(self, entry: WorkerEntry) -> None:
        router = self.router
        sock = router.worker_socks.get(entry.worker_id)
        if sock is not None:  # decode / colocated: the router's own connection
            await sock.send_multipart([router.seal(WorkerDrain())])
            return
        sock = router.ctx.socket(zmq.DEALER)  # a prefill worker: only decode workers talk to it otherwise
        sock.setsockopt(zmq.LINGER, PREFILL_SEND_LINGER_MS)
        router.key.curve_client(sock)
        try:
            sock.connect(entry.hello.address)
            await sock.send_multipart([router.seal(WorkerDrain())])
        finally:
            sock.close()

    def worker_exited(self, worker_id: str, code: int) -> bool:
        """The launcher saw `worker_id` exit with `code`: True if it was leaving (drained,
        or a start that failed); False for a failure the caller handles as such."""
        entry = self.router.registry.workers.get(worker_id)
        if entry is not None and entry.state == EXITING:
            self.retire(entry, code)
            return True
        if entry is None and worker_id in self.departed:  # retired by its silence before the launcher saw it
            self.departed[worker_id].exit_code = code
            return True
        if entry is None and worker_id in self.starting:
            role, _ = self.starting.pop(worker_id)
            self.departed[worker_id] = Departed(worker_id, role, code, True)
            print(f"router: {role} worker {worker_id} exited with code {code} before registering",
                  file=sys.stderr, flush=True)
            return True
        return False

    def leaving(self, worker_id: str) -> bool:
        """Whether the router asked `worker_id` to go (a launcher must not restart it)."""
        entry = self.router.registry.workers.get(worker_id)
        return worker_id in self.departed or (entry is not None and entry.state in (DRAINING, EXITING))

    def retire(self, entry: WorkerEntry, code: int | None) -> None:
        """`entry` left its pool: forget it, and start it in its next role if it has one."""
        router, wid = self.router, entry.worker_id
        router.registry.retire(entry, self.clock.monotonic())
        router.disconnect_worker(wid)
        router.metrics.forget_worker(wid, entry.role)
        self._stopped.discard(wid)
        self.departed[wid] = Departed(wid, entry.role, code, self._owns(wid), entry.routed)
        for old in list(self.departed)[:-MAX_DEPARTED]:
            del self.departed[old]
        print(f"router: {entry.role} worker {wid} left its pool (exit code {'?' if code is None else code})",
              file=sys.stderr, flush=True)
        if wid in self.next_role and self.launcher is not None:
            role, engine = self.next_role.pop(wid)
            self.launcher.spawn(role, wid, engine)
            self._starting(wid, role)

    def _starting(self, worker_id: str, role: str) -> None:
        self.starting[worker_id] = (role, self.clock.monotonic())
        self.departed.pop(worker_id, None)
        self.router.failed.pop(worker_id, None)

    def registered(self, worker_id: str) -> bool:
        """Whether `worker_id` is registered and alive (a launcher's start succeeded)."""
        entry = self.router.registry.workers.get(worker_id)
        return entry is not None and entry.alive

    def worker_failed(self, worker_id: str, role: str, why: str) -> None:
        """The launcher gave up starting `worker_id` (and ended it for good): `pools` and
        /health show it failed, saying `why`, until a worker of that id starts again."""
        self.starting.pop(worker_id, None)
        entry = self.router.registry.workers.get(worker_id)
        self.next_role.pop(worker_id, None)
        if entry is not None:  # it served once, then kept failing to come back
            self.retire(entry, None)
        self.departed[worker_id] = Departed(worker_id, role, None, True, reason=why)
        self.router.failed[worker_id] = (role, why)
        print(f"router: {role} worker {worker_id} failed: {why}", file=sys.stderr, flush=True)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise PoolError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
