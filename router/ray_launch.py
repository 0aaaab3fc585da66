"""Ray as the placement and lifecycle layer (`pdserve serve --ray auto|ADDRESS`,
docs/deploy.md "A Ray cluster"): the driver's side.

Each worker is one Ray actor (router/ray_actor.py), placed on a node that has its role's
resources (`--prefill-resources '{"prefill_pool": 1}'`; a GPU worker also takes one GPU)
and restarted by Ray whenever it dies -- on another node that fits when its own is gone.
The actor runs the worker as its child process, bound to the node's address, with host id
`ray:<node id>` (two Ray nodes are two hosts, common/worker/host.py, so a P/D pair across
them never takes a shared-memory path), registered with the router at the control
address it is given. The router's registry is how workers find each other: a restarted
worker says hello from its new address and takes traffic again, and a decode worker meets
a prefill worker's address in the first request that names it. Ray carries no KV and no
tokens; the router and the KV transports do, as without Ray.

The secret never travels through Ray: actor arguments are kept in Ray's control store and
sent in the clear unless Ray's own TLS is on. Each actor is given the path of the secret
file instead, which must be present on every node (as a mounted Kubernetes secret is)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from common.config import ConfigError
from common.worker.spec import WorkerSpec
from router.deploy import DeploymentConfig, RayPlacement
from router.launch import LaunchError
from router.registry import PoolError
from router.ray_actor import WorkerActor
from router.background import Background

READY_TIMEOUT_S = 300.0  # placement (a node may still be joining) plus the model's load
POLL_S = 0.5  # how often RayPool asks the actors whether their worker exited
NAME_FREE_S = 10.0  # how long an ended actor's name may take to be free again
MAX_FAILED_STARTS = 3  # a worker that exits this many times in a row without registering is failed


def import_ray() -> Any:
    """The `ray` module, or a ConfigError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ConfigError("--ray needs Ray on this machine and every node: pip install 'pdserve[ray]'") from None
    return ray


def parse_resources(text: str, flag: str) -> dict[str, float]:
    """`--prefill-resources '{"prefill_pool": 1, "CPU": 2}'`: the Ray resources one worker
    needs, each a number >= 0."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{flag} must be a JSON object of Ray resources, e.g. '{{\"prefill_pool\": 1}}': {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{flag} must be a JSON object of Ray resources, e.g. '{{\"prefill_pool\": 1}}', got {text!r}")
    for name, amount in data.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount < 0:
            raise ConfigError(f"{flag}: resource {name!r} must be a number >= 0, got {amount!r}")
    return {name: float(amount) for name, amount in data.items()}


def actor_options(resources: dict[str, float], device: str, threads: int) -> dict[str, Any]:
    """Ray's options for one worker's actor: its role's custom resources; CPUs: its thread
    count, GPUs: one for a GPU worker (Ray then shows it that GPU alone), unless the
    resources name "CPU" or "GPU"; restarted whenever it dies, its calls never retried."""
    custom = dict(resources)
    num_cpus = custom.pop("CPU", float(threads))
    num_gpus = custom.pop("GPU", 1.0 if device.startswith("cuda") else 0.0)
    if device.startswith("cuda") and num_gpus <= 0:
        raise ConfigError(f"a worker on {device} needs a GPU from Ray: its resources give it GPU {num_gpus:g}")
    options: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus, max_restarts=-1, max_task_retries=0)
    if "memory" in custom:
        options["memory"] = custom.pop("memory")
    return dict(options, resources=custom)


def connect(placement: RayPlacement) -> str:
    """Join the Ray cluster at `placement.address` as its driver; returns this node's
    address (the router binds it unless --host says otherwise). A role's custom resource
    that no node has is reported: its workers wait until a node with it joins."""
    ray = import_ray()
    try:
        ray.init(address=placement.address, namespace=placement.namespace, log_to_driver=True)
    except ConnectionError as e:
        raise ConfigError(f"--ray {placement.address}: no Ray cluster there ({e}); start one with "
                          f"`ray start --head`, or name its head as HOST:PORT") from None
    have = ray.cluster_resources()
    for role, resources in placement.resources.items():
        missing = sorted(set(resources) - set(have) - {"CPU", "GPU", "memory"})
        if missing:
            print(f"pdserve: no Ray node has {', '.join(missing)} yet: {role} workers wait for one",
                  file=sys.stderr, flush=True)
    return ray.util.get_node_ip_address()


def dialable(address: str, node_address: str) -> str:
    """The router's control address as the other nodes dial it: a wildcard bind
    (`--host 0.0.0.0`) is reached at this node's address."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    if host in ("0.0.0.0", "*", "::", "[::]"):
        return f"tcp://{node_address}:{port}"
    return address


@dataclass
class RayWorker:
    """A worker's actor: its name (the actor's, in the deployment's namespace), role and,
    once ready, what its worker reported (WorkerActor.info)."""

    name: str
    role: str
    actor: Any
    info: dict = field(default_factory=dict)


class RayLauncher:
    """Owns one deployment's worker actors, one per worker, each placed by its role's
    resources and restarted by Ray (the launcher shape: `spawn(role)` -> handle,
    `stop(handle)`). The driver must be connected (`connect`) first."""

    def __init__(self, dep: DeploymentConfig, control: str, ready_timeout_s: float = READY_TIMEOUT_S) -> None:
        if dep.ray is None:
            raise ValueError("RayLauncher needs a deployment placed by Ray (DeploymentConfig.ray)")
        self.ray = import_ray()
        self.dep, self.placement = dep, dep.ray
        self.control = dialable(control, self.ray.util.get_node_ip_address())
        self.ready_timeout_s = ready_timeout_s
        self.templates = {spec.worker.role: spec for spec in dep.workers}  # what `spawn` starts more of
        self.spawned = {role: len(dep.role(role)) for role in self.templates}
        self.workers: list[RayWorker] = []
        self._actor_class = self.ray.remote(WorkerActor)

    def start_all(self) -> None:
        """Start every worker of the deployment; return once each is ready."""
        self.wait_ready([self._start(spec) for spec in self.dep.workers])

    def spawn(self, role: str, worker_id: str = "", engine: dict[str, Any] | None = None) -> RayWorker:
        """One more worker of `role`, like the deployment's others but for the engine
        options in `engine`, named `worker_id` or ROLE-N; it is ready when `wait_ready`
        returns. ConfigError for a role the deployment has none of, or a wrong option."""
        if role not in self.templates:
            raise ConfigError(f"this deployment has no {role} workers to add to (Ray places prefill and "
                              f"decode workers)")
        template = self.templates[role]
        options = template.engine.replace(**engine) if engine else template.engine
        taken = {h.name for h in self.workers}
        while not worker_id:
            n = self.spawned[role]
            self.spawned[role] = n + 1
            worker_id = "" if f"{role}-{n}" in taken else f"{role}-{n}"
        return self._start(dataclasses.replace(template, engine=options, worker=dataclasses.replace(
            template.worker, worker_id=worker_id)))

    def _start(self, spec: WorkerSpec) -> RayWorker:
        if spec.worker.secret:
            raise ValueError("a worker spec sent to Ray must not carry the secret: the actor reads the secret file")
        role, name = spec.worker.role, spec.worker.worker_id
        options = actor_options(self.placement.resources.get(role, {}), spec.engine.device.device,
                                spec.engine.device.num_threads or 1)
        try:
            actor = self._actor_class.options(name=name, namespace=self.placement.namespace, **options).remote(
                spec.to_dict(), self.placement.secret_file, self.control, self.ready_timeout_s)
        except ValueError as e:  # the name is taken in this namespace
            raise ConfigError(f"cannot start worker actor {name}: {e} (another deployment in Ray namespace "
                              f"{self.placement.namespace!r}? give this one --ray-namespace)") from None
        handle = RayWorker(name, role, actor)
        self.workers.append(handle)
        return handle

    def wait_ready(self, handles: list[RayWorker]) -> None:
        """Wait until each worker is placed and ready; LaunchError names one that failed
        to start or was not placed in time (no node with its resources)."""
        ray = self.ray
        deadline = time.monotonic() + self.ready_timeout_s
        refs = {h.name: h.actor.info.remote() for h in handles}
        for h in handles:
            try:
                h.info = ray.get(refs[h.name], timeout=max(0.1, deadline - time.monotonic()))
            except ray.exceptions.GetTimeoutError:
                raise LaunchError(f"worker {h.name} not ready after {self.ready_timeout_s:.0f} s: does a Ray node "
                                  f"have what it needs ({self.placement.resources.get(h.role, {}) or 'no custom resources'})?"
                                  f" `ray status` shows the cluster's resources") from None
            except ray.exceptions.RayActorError as e:
                raise LaunchError(f"worker {h.name} failed to start: {e}") from None

    def stop(self, handle: RayWorker, timeout: float = 15.0) -> None:
        """Drain the worker (SIGTERM), then end its actor for good (Ray does not restart it)."""
        self._stop_all([handle], timeout)

    def _stop_all(self, handles: list[RayWorker], timeout: float) -> None:
        self.end(handles, timeout)
        for h in handles:
            if h in self.workers:
                self.workers.remove(h)

    def end(self, handles: list[RayWorker], timeout: float) -> list[int | None]:
        """Drain the workers (SIGTERM, SIGKILL after `timeout`) and end their actors for
        good; their exit codes (None: the actor did not answer). Their handles stay in
        `workers`."""
        ray = self.ray
        refs = [h.actor.stop.remote(timeout) for h in handles]
        codes = []
        for ref in refs:
            try:
                codes.append(ray.get(ref, timeout=timeout + 5))
            except ray.exceptions.RayError:
                codes.append(None)  # already gone, or not answering: killed below either way
        for h in handles:
            self.kill(h)
        return codes

    def kill(self, handle: RayWorker, restart: bool = False) -> None:
        """End the worker's actor at once (and the worker with it); Ray starts it again
        only if `restart`."""
        with contextlib.suppress(self.ray.exceptions.RayError):  # already dead
            self.ray.kill(handle.actor, no_restart=not restart)

    def close(self, timeout: float = 15.0) -> None:
        """Stop every worker and leave the cluster."""
        try:
            self._stop_all(list(self.workers), timeout)
        finally:
            self.ray.shutdown()


class RayPool(Background):
    """The pool control API's launcher under Ray (router/pool_launch.py's WorkerLauncher,
    router/control.py): a new worker is one more actor placed by its role's resources; a
    stopped one drains and its actor ends for good. It owns every worker of the deployment.

    Its watch, on the router's loop (`watching(control)`, then `start`), asks each actor
    whether its worker has exited (router/ray_actor.py: the actor stays). A worker that
    the router let go has its actor ended for good -- Ray does not restart it -- and is
    reported to the control plane with its exit code; one that exited unasked has its
    actor killed so that Ray restarts both. Starts are bounded: a worker that exits
    `max_failed_starts` times in a row without registering, whose actor could not be
    created (its worker exited before it was ready), or that has not registered within
    `start_timeout_s` of its start, has its actor ended for good and is reported failed,
    with the reason (`pdserve pools`, /health)."""

    def __init__(self, launcher: RayLauncher, stop_timeout_s: float = 15.0,
                 max_failed_starts: int = MAX_FAILED_STARTS) -> None:
        self.launcher = launcher
        self.stop_timeout_s = stop_timeout_s
        self.max_failed_starts = max_failed_starts
        self.start_timeout_s = launcher.ready_timeout_s
        self.failed_starts: dict[str, int] = {}  # worker -> exits in a row without registering
        self.waiting: dict[str, float] = {}  # never-registered worker -> when the watch first saw it (monotonic s)
        self._joined: set[str] = set()  # workers that registered since they were started
        self.control: Any = None  # router/control.py's ControlPlane: worker_exited, leaving
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
        for handle, code, why in await asyncio.to_thread(self.exited):
            if handle.name in self._stopping:
                continue  # its `stop` ends it and reports it
            leaving = self.control.leaving(handle.name)
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
                    out.append((h, None, _last_line(str(e))))
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


def _last_line(text: str) -> str:
    """The last non-empty line of an error's text (Ray's carry a traceback first)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text
