"""Who starts and stops the workers of a pool on the control API's behalf
(router/pools/control.py). `WorkerLauncher` is the seam: `LocalLauncher` starts local worker
processes for `pdserve serve` with the deployment's own engine options; a cluster layer
(Ray actors) implements the same three methods. A router running alone has none: workers
join it (`pdserve worker --join`) and it only drains whom it is told."""
from __future__ import annotations

import dataclasses
import signal
from typing import Any, Protocol

from pdserve.common.config import ConfigError
from pdserve.common.worker.spec import WorkerSpec
from pdserve.common.worker.host import resolve_backend
from pdserve.router.launch.deployment import DeploymentConfig
from pdserve.router.launch.local import Launcher
from pdserve.router.core.registry import PoolError

ELASTIC_BACKENDS = ("shm", "tcp", "cuda_ipc", "")  # gloo/nccl groups are fixed at start ("": colocated)


class WorkerLauncher(Protocol):
    """Starts workers that register with the router on their own (a hello), and stops them."""

    def spawn(self, role: str, worker_id: str = "", engine: dict[str, Any] | None = None) -> str:
        """Start one worker of `role` (named `worker_id`, or a fresh name; with the engine
        options in `engine` changed from the deployment's, "device" included); returns its
        worker id. PoolError if it cannot."""
        ...

    def stop(self, worker_id: str) -> None:
        """End a worker this launcher started (it drains first, as on SIGTERM)."""
        ...

    def owns(self, worker_id: str) -> bool:
        """Whether this launcher started `worker_id` (and so can stop and restart it)."""
        ...


class LocalLauncher:
    """Worker processes on this host for `pdserve serve`: each new worker is the
    deployment's spec of its role (its engine options, liveness settings and transport),
    renamed, reporting to the router's control socket. Owns nothing but the names it
    started; the processes belong to the `Launcher` (stopped with the deployment)."""

    def __init__(self, launcher: Launcher, dep: DeploymentConfig, control_address: str) -> None:
        self.launcher = launcher
        self.dep = dep
        self.control_address = control_address

    def spawn(self, role: str, worker_id: str = "", engine: dict[str, Any] | None = None) -> str:
        template = self._template(role)
        try:
            options = template.engine.replace(**engine) if engine else template.engine
        except ConfigError as e:
            raise PoolError(f"engine options {engine}: {e}") from None
        taken = {w.name for w in self.launcher.workers}
        name = worker_id or next(f"{role}-{i}" for i in range(len(taken) + 1) if f"{role}-{i}" not in taken)
        worker = dataclasses.replace(template.worker, role=role, worker_id=name, report_to=self.control_address,
                                     prefill_peers=())  # decode workers handshake on the first request naming a P
        if role != "colocated" and not self.dep.kv_transfer:  # the first P/D worker of a colocated deployment
            worker = dataclasses.replace(worker, kv_transfer=resolve_backend("auto", options.device.device))
        self.launcher.start(dataclasses.replace(template, engine=options, worker=worker))
        return name

    def stop(self, worker_id: str) -> None:
        for wp in self.launcher.workers:
            if wp.name == worker_id and wp.proc.poll() is None:
                wp.proc.send_signal(signal.SIGTERM)

    def owns(self, worker_id: str) -> bool:
        return any(w.name == worker_id for w in self.launcher.workers)

    def _template(self, role: str) -> WorkerSpec:
        """The deployment's spec for a new worker of `role` (one of that role's, else any:
        a colocated deployment can grow P/D pools and the other way round; the router
        routes to P/D pairs while there are both). PoolError where it cannot take one."""
        if self.dep.kv_transfer not in ELASTIC_BACKENDS:
            raise PoolError(f"this deployment's kv transfer is {self.dep.kv_transfer}: its group is fixed at "
                            f"start, so its pools cannot grow (use shm, tcp or cuda_ipc for elastic pools)")
        same = self.dep.role(role)
        return same[0] if same else self.dep.workers[0]
