"""The SLO planner loop against a fake control plane (its pools, what it was asked to do)."""
from __future__ import annotations

import collections
from types import SimpleNamespace
from pdserve.common.clock import ManualClock
from pdserve.common.wire.messages import PoolWorker, WorkerHello, WorkerStatus
from pdserve.router.core.metrics import RouterMetrics
from pdserve.router.core.registry import SERVING, WorkerRegistry


INTERVAL = 5.0


class FakeControl:
    """The control API's in-process methods over a real registry: a new or re-roled
    worker registers `delay` windows after it is asked for; a drained one leaves at once."""

    def __init__(self, clock: ManualClock, roles: dict[str, str]) -> None:
        self.router = SimpleNamespace(clock=clock, registry=WorkerRegistry(stale_after_s=1e9), metrics=RouterMetrics(),
                                      finished_log=collections.deque(), busy=0)
        self.calls: list[tuple] = []
        self.starting: dict[str, tuple[str, float]] = {}
        for wid, role in roles.items():
            self.register(wid, role)

    def register(self, wid: str, role: str) -> None:
        hello = WorkerHello(wid, role, f"tcp://127.0.0.1:{7000 + len(self.router.registry.workers)}", "cpu", 100, 16,
                            "fp")
        entry = self.router.registry.hello(hello, self.router.clock.monotonic())
        entry.status = WorkerStatus(wid, role, 0, 0, 70, 100)

    def scale(self, role: str, delta: int, engine: dict | None = None):
        self.calls.append(("scale", role, delta, engine))
        wid = f"{role}-new{len(self.calls)}"
        self.starting[wid] = (role, self.router.clock.monotonic() + INTERVAL)
        return SimpleNamespace(worker_ids=[wid])

    def change_role(self, worker_id: str, role: str, engine: dict | None = None):
        self.calls.append(("change_role", worker_id, role))
        self.router.registry.workers.pop(worker_id)
        self.starting[worker_id] = (role, self.router.clock.monotonic() + INTERVAL)

    def drain(self, worker_ids: list[str]):
        self.calls.append(("drain", *worker_ids))
        for w in worker_ids:
            self.router.registry.workers.pop(w)

    def pools(self) -> list[PoolWorker]:
        now = self.router.clock.monotonic()
        for wid, (role, at) in list(self.starting.items()):
            if now >= at:
                del self.starting[wid]
                self.register(wid, role)
        out = [PoolWorker(e.worker_id, e.role, e.state) for e in self.router.registry.workers.values()]
        return out + [PoolWorker(w, role, "starting") for w, (role, _) in self.starting.items()]

    def serving(self, role: str) -> int:
        return sum(e.role == role and e.state == SERVING for e in self.router.registry.workers.values())
