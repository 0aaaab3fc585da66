"""RayPool: the pool control API's launcher under Ray (router/pools/control.py,
router/pools/launch.py's WorkerLauncher), over the worker actors of router/launch/ray.py.
It runs in the router actor (router/deploy/ray_router.py), on the router's loop."""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from typing import Any

from pdserve.common.config import ConfigError
from pdserve.router.core.background import Background
from pdserve.router.launch.ray import RayLauncher, RayWorker, last_line
from pdserve.router.core.registry import PoolError

POLL_S = 0.5  # how often RayPool asks the actors whether their worker exited
NAME_FREE_S = 10.0  # how long an ended actor's name may take to be free again
MAX_FAILED_STARTS = 3  # a worker that exits this many times in a row without registering is failed


class RayPool(Background):
    """The pool control API's launcher under Ray (router/pools/launch.py's WorkerLauncher,
    router/pools/control.py): a new worker is one more actor placed by its role's resources; a
    stopped one drains and its actor ends for good. It owns every worker of the deployment.

    Its watch, on the router's loop (`watching(control)`, then `start`), asks each actor
    whether its worker has exited (router/launch/ray_actor.py: the actor stays). A worker that
    the router let go has its actor ended for good -- Ray does not restart it -- and is
    reported to the control plane with its exit code; one that exited unasked has its
    actor killed so that Ray restarts both. Starts are bounded: a worker that exits
    `max_failed_starts` times in a row without registering, whose actor could not be
    created (its worker exited before it was ready), or that has not registered within
    `start_timeout_s` of its start, has its actor ended for good and is reported failed,
    with the reason (`pdserve pools`, /health).

    Under a restarted router it takes over the drains of the one it replaces: an adopted
    worker whose actor was being stopped is stopped; one that exits with code 0 before it
    registers with this router was drained by that one (a worker exits 0 only when told
    to drain), so its actor ends for good. Its counts of failed starts begin again."""

    def __init__(self, launcher: RayLauncher, stop_timeout_s: float = 15.0,
                 max_failed_starts: int = MAX_FAILED_STARTS) -> None:
        self.launcher = launcher
        self.stop_timeout_s = stop_timeout_s
        self.max_failed_starts = max_failed_starts
        self.start_timeout_s = launcher.ready_timeout_s
        self.failed_starts: dict[str, int] = {}  # worker -> exits in a row without registering
        self.waiting: dict[str, float] = {}  # never-registered worker -> when the watch first saw it (monotonic s)
        self._joined: set[str] = set()  # workers that registered since they were started
        self.control: Any = None  # router/pools/control.py's ControlPlane: worker_exited, leaving
        self.names: set[str] = set()  # every worker it started (the deployment's: in launcher.workers)
        self._ended: queue.SimpleQueue[tuple[RayWorker, int | None]] = queue.SimpleQueue()
        self._stopping: set[str] = set()  # workers whose `stop` is under way
        self._polls: dict[str, tuple[RayWorker, Any]] = {}  # worker -> its unanswered exit_code call

    def spawn(self, role: str, worker_id: str = "", engine: dict[str, Any] | None = None) -> str:
        try:
            handle = self.launcher.spawn(role, worker_id, engine)
        except ConfigError as e:
            raise PoolError(str(e)) from None
        self.names.add(handle.name)
        return handle.name

    def stop(self, worker_id: str) -> None:
        """Drain the worker and end its actor, off the router's loop (it may take up to
        the stop timeout); the watch reports its exit."""
        handle = self._handle(worker_id)
        if handle is None or worker_id in self._stopping:
            return
        self._stopping.add(worker_id)
        threading.Thread(target=self._end, args=(handle,), name=f"stop-{worker_id}", daemon=True).start()

    def owns(self, worker_id: str) -> bool:
        return worker_id in self.names or self._handle(worker_id) is not None

    def watching(self, control: Any) -> "RayPool":
        """Report exits to `control` once started."""
        self.control = control
        return self

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            try:
                await self.tick()
            except Exception as e:  # a bug, or Ray not answering: the next turn tries again
                print(f"pdserve: watching the Ray workers: {type(e).__name__}: {e}", file=sys.stderr, flush=True)

    async def tick(self) -> None:
        """End the actors of the workers that exited; report those the router let go, and
        those whose starts failed."""
        for handle, why in self._overdue():
            await self._fail(handle, why)
        for handle in list(self.launcher.workers):
            if handle.adopted and handle.info.get("stopping"):
                self.stop(handle.name)  # the router this one replaces was stopping it
        for handle, code, why in await asyncio.to_thread(self.exited):
            if handle.name in self._stopping:
                continue  # its `stop` ends it and reports it
            leaving = self.control.leaving(handle.name) or (handle.adopted and code == 0 and
                                                             handle.name not in self._joined)
            why = why or (None if leaving else self._failed_start(handle.name, code))
            if why is not None:
                await self._fail(handle, why)
                continue
            await asyncio.to_thread(self._kill, handle, leaving)
            if leaving:
                self._ended.put((handle, code))
        while not self._ended.empty():
            handle, code = self._ended.get()
            self._stopping.discard(handle.name)
            if handle in self.launcher.workers:
                self.launcher.workers.remove(handle)  # first: a role change starts one under its name
            self.control.worker_exited(handle.name, code)

    def _overdue(self) -> list[tuple[RayWorker, str]]:
        """Follow who has registered; the workers never registered within start_timeout_s
        of their start, with why they fail."""
        now, out = time.monotonic(), []
        for h in list(self.launcher.workers):
            if self.control.registered(h.name):
                self._joined.add(h.name)
                self.failed_starts.pop(h.name, None)
                self.waiting.pop(h.name, None)
            elif h.name not in self._joined and h.name not in self._stopping:
                since = self.waiting.setdefault(h.name, now)
                if now - since > self.start_timeout_s:
                    out.append((h, f"not registered within {self.start_timeout_s:.0f} s of its start (does a Ray "
                                   f"node have {self.placement_of(h) or 'its resources'}? `ray status` shows them)"))
        return out

    def placement_of(self, handle: RayWorker) -> dict[str, float]:
        return self.launcher.placement.resources.get(handle.role, {})

    def _failed_start(self, name: str, code: int | None) -> str | None:
        """Count a failure (exit code != 0) of a worker not registered since its start;
        why it fails for good once there were max_failed_starts in a row, else None."""
        if code in (None, 0) or self.control.registered(name):
            return None
        self._joined.discard(name)  # its next start must register again
        n = self.failed_starts[name] = self.failed_starts.get(name, 0) + 1
        if n < self.max_failed_starts:
            return None
        return (f"exited with code {code} before registering, {n} times in a row (its actor's Ray log has its "
                f"output)")

    async def _fail(self, handle: RayWorker, why: str) -> None:
        """End `handle`'s actor for good and report it failed."""
        print(f"pdserve: worker {handle.name} failed: {why}: its actor ends", file=sys.stderr, flush=True)
        await asyncio.to_thread(self.launcher.kill, handle)
        if handle in self.launcher.workers:
            self.launcher.workers.remove(handle)
        self._polls.pop(handle.name, None)
        self.waiting.pop(handle.name, None)
        self.failed_starts.pop(handle.name, None)
        self._joined.discard(handle.name)
        self.control.worker_failed(handle.name, handle.role, why)

    def exited(self) -> list[tuple[RayWorker, int | None, str | None]]:
        """The workers whose process has exited while their actor stays, with its code,
        as far as their actors have answered (one starting or restarting is asked again
        later); and those whose actor could not be created, with why (code None)."""
        ray = self.launcher.ray
        for h in list(self.launcher.workers):
            if h.name not in self._polls and h.name not in self._stopping:
                self._polls[h.name] = (h, h.actor.exit_code.remote())
        if not self._polls:
            return []
        refs = [ref for _, ref in self._polls.values()]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for name, (h, ref) in list(self._polls.items()):
            if ref not in ready:
                continue
            del self._polls[name]
            try:
                code = ray.get(ref)
            except ray.exceptions.RayError as e:
                if getattr(e, "actor_init_failed", False):  # Ray does not restart it
                    out.append((h, None, last_line(str(e))))
                continue  # else the actor died: Ray starts it again, or it was ended
            if code is not None:
                out.append((h, code, None))
        return out

    def _end(self, handle: RayWorker) -> None:
        code = self.launcher.end([handle], self.stop_timeout_s)[0]
        self._wait_gone(handle.name)
        self._ended.put((handle, code))

    def _kill(self, handle: RayWorker, leaving: bool) -> None:
        if leaving:
            print(f"pdserve: worker {handle.name} drained: its actor ends", file=sys.stderr, flush=True)
        else:
            print(f"pdserve: worker {handle.name} exited unasked: Ray starts it again", file=sys.stderr, flush=True)
        self.launcher.kill(handle, restart=not leaving)
        if leaving:
            self._wait_gone(handle.name)

    def _wait_gone(self, name: str) -> None:
        """Until Ray has freed the actor's name (a role change starts a worker under it)."""
        ray, deadline = self.launcher.ray, time.monotonic() + NAME_FREE_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=self.launcher.placement.namespace)
            except ValueError:
                return
            time.sleep(0.1)

    def _handle(self, worker_id: str) -> RayWorker | None:
        return next((h for h in self.launcher.workers if h.name == worker_id), None)
