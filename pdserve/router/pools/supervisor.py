"""The launcher's watch over its worker processes, run by `pdserve serve` on the router's
loop: a worker that exits is reaped at once (no zombie for a peer's liveness check to
mistake for a live process), reported with its exit code and the tail of its log, taken
out of rotation (its requests are re-routed, router/core/recovery.py) and, with `--restart`,
started again. Restarted prefill workers come back at a new address, which decode
workers handshake with on the first request that names it; a restarted decode worker is
given the prefill workers' current addresses."""
from __future__ import annotations

import asyncio
import dataclasses
import sys

from pdserve.router.pools.control import ControlPlane
from pdserve.router.core.router import Router
from pdserve.router.launch.local import Launcher, LaunchError, WorkerProcess
from pdserve.router.core.background import Background

POLL_S = 0.2  # how often exits are looked for: bounds the detection time of a dead worker


class Supervisor(Background):
    """Owns the reaping task; restarts when asked to. A worker the pool control let go
    (drained, router/pools/control.py) is its business, not a failure: never restarted."""

    def __init__(self, router: Router, launcher: Launcher, restart: bool, control: ControlPlane | None = None) -> None:
        self.router = router
        self.launcher = launcher
        self.restart = restart
        self.control = control

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(POLL_S)
            for wp in self.launcher.reap():
                if self.control is not None and self.control.worker_exited(wp.name, wp.proc.returncode):
                    continue
                self.report(wp)
                if self.restart and not (self.control is not None and self.control.leaving(wp.name)):
                    await self._restart(wp)

    def report(self, wp: WorkerProcess) -> None:
        tail = "\n    ".join(wp.log_tail(10).splitlines())
        print(f"pdserve: worker {wp.name} (pid {wp.proc.pid}) exited with code {wp.proc.returncode}; "
              f"last log lines:\n    {tail}", file=sys.stderr, flush=True)
        self.router.worker_exited(wp.name, f"exited with code {wp.proc.returncode}")

    async def _restart(self, wp: WorkerProcess) -> None:
        assert wp.spec is not None
        spec = wp.spec
        if spec.worker.role == "decode" and spec.worker.kv_transfer not in ("gloo", "nccl"):
            peers = tuple(w.info["address"] for w in self.launcher.workers
                          if w.info.get("role") == "prefill" and w.proc.poll() is None)
            spec = dataclasses.replace(spec, worker=dataclasses.replace(spec.worker, prefill_peers=peers))
        if spec.worker.kv_transfer in ("gloo", "nccl"):
            print(f"pdserve: not restarting {wp.name}: a {spec.worker.kv_transfer} group cannot take a new rank",
                  file=sys.stderr, flush=True)
            return
        new = self.launcher.start(spec)
        try:
            await asyncio.to_thread(self.launcher.wait_ready, [new])
        except LaunchError as e:
            print(f"pdserve: restart of {wp.name} failed: {e}", file=sys.stderr, flush=True)
            return
        print(f"pdserve: restarted worker {wp.name} (pid {new.proc.pid}) at {new.address}", file=sys.stderr,
              flush=True)
