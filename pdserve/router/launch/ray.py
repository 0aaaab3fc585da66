"""Ray as the placement and lifecycle layer (`pdserve serve --ray auto|ADDRESS`,
docs/deploy.md "A Ray cluster"): the worker actors, as the router actor
(router/deploy/ray_router.py) starts, adopts, watches and ends them.

Each worker is one Ray actor (router/launch/ray_actor.py), placed on a node that has its role's
resources (`--prefill-resources '{"prefill_pool": 1}'`; a GPU worker also takes one GPU)
and restarted by Ray whenever it dies -- on another node that fits when its own is gone.
The actor runs the worker as its child process, bound to the node's address, with host id
`ray:<node id>` (two Ray nodes are two hosts, common/worker/host.py, so a P/D pair across
them never takes a shared-memory path), registered with the router at the control
address it is given. The router's registry is how workers find each other: a restarted
worker says hello from its new address and takes traffic again, and a decode worker meets
a prefill worker's address in the first request that names it. Ray carries no KV and no
tokens; the router and the KV transports do, as without Ray.

Every actor is detached (owned by the cluster, not by whoever created it) and named by
its worker id in the deployment's Ray namespace: a router actor that Ray restarts finds
the workers of the one it replaces there by name (`RayLauncher.adopt`) and takes them
over, while they say hello to it again on their own.

The secret never travels through Ray: actor arguments are kept in Ray's control store and
sent in the clear unless Ray's own TLS is on. Each actor is given the path of the secret
file instead, which must be present on every node (as a mounted Kubernetes secret is)."""
from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.config import ConfigError
from pdserve.common.config_base import json_object
from pdserve.common.worker.spec import WorkerSpec
from pdserve.router.launch.deployment import DeploymentConfig, RayPlacement
from pdserve.router.launch.local import LaunchError
from pdserve.router.launch.ray_actor import WorkerActor

READY_TIMEOUT_S = 300.0  # placement (a node may still be joining) plus the model's load
ROUTER_ACTOR = "pdserve-router"  # the router actor's name; every other actor named in the namespace is a worker


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
    data = json_object(text, flag, """ of Ray resources, e.g. '{"prefill_pool": 1}'""")
    for name, amount in data.items():
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) or amount < 0:
            raise ConfigError(f"{flag}: resource {name!r} must be a number >= 0, got {amount!r}")
    return {name: float(amount) for name, amount in data.items()}


def actor_options(resources: dict[str, float], device: str, threads: int) -> dict[str, Any]:
    """Ray's options for one worker's actor: its role's custom resources; CPUs: its thread
    count, GPUs: one for a GPU worker (Ray then shows it that GPU alone), unless the
    resources name "CPU" or "GPU"; detached, restarted whenever it dies, its calls never
    retried."""
    custom = dict(resources)
    num_cpus = custom.pop("CPU", float(threads))
    num_gpus = custom.pop("GPU", 1.0 if device.startswith("cuda") else 0.0)
    if device.startswith("cuda") and num_gpus <= 0:
        raise ConfigError(f"a worker on {device} needs a GPU from Ray: its resources give it GPU {num_gpus:g}")
    options: dict[str, Any] = dict(num_cpus=num_cpus, num_gpus=num_gpus, lifetime="detached", max_restarts=-1,
                                   max_task_retries=0)
    if "memory" in custom:
        options["memory"] = custom.pop("memory")
    return dict(options, resources=custom)


def connect(placement: RayPlacement) -> str:
    """Join the Ray cluster at `placement.address` as its driver; returns this node's
    address. A role's custom resource that no node has is reported: its actors wait
    until a node with it joins."""
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
            print(f"pdserve: no Ray node has {', '.join(missing)} yet: the {role} actors wait for one",
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
    once ready, what its worker reported (WorkerActor.info); `adopted`: started by the
    router this one replaced."""

    name: str
    role: str
    actor: Any
    info: dict = field(default_factory=dict)
    adopted: bool = False


class RayLauncher:
    """Owns one deployment's worker actors, one per worker, each placed by its role's
    resources and restarted by Ray (the launcher shape: `spawn(role)` -> handle,
    `stop(handle)`). Runs where Ray is connected (the router actor). `adopt`: this
    router is Ray's restart of one that started the workers: it takes over theirs."""

    def __init__(self, dep: DeploymentConfig, control: str, ready_timeout_s: float = READY_TIMEOUT_S,
                 adopt: bool = False) -> None:
        if dep.ray is None:
            raise ValueError("RayLauncher needs a deployment placed by Ray (DeploymentConfig.ray)")
        self.ray = import_ray()
        self.dep, self.placement = dep, dep.ray
        self.control = dialable(control, self.ray.util.get_node_ip_address())
        self.ready_timeout_s = ready_timeout_s
        self.templates = {spec.worker.role: spec for spec in dep.workers}  # what `spawn` starts more of
        self.spawned = {role: len(dep.role(role)) for role in self.templates}
        self.workers: list[RayWorker] = []
        self.adopting = adopt
        self._actor_class = self.ray.remote(WorkerActor)

    def start_all(self) -> None:
        """Start every worker of the deployment (or, `adopting`, take over the running
        ones); return once each is ready."""
        if self.adopting:
            self.adopt()
        else:
            self.wait_ready([self._start(spec) for spec in self.dep.workers])

    def adopt(self) -> None:
        """Take over the worker actors that the router this one replaces left running:
        every actor named in the deployment's namespace but the router, with the role and
        ready info it reports; the spawn counts go on after the names taken. One that does
        not answer within the ready timeout, or whose actor has died for good, is ended."""
        ray, namespace = self.ray, self.placement.namespace
        handles = []
        for entry in ray.util.list_named_actors(all_namespaces=True):
            if entry["namespace"] == namespace and entry["name"] != ROUTER_ACTOR:
                with contextlib.suppress(ValueError):  # ended since it was listed
                    handles.append(RayWorker(entry["name"], "", ray.get_actor(entry["name"], namespace=namespace),
                                             adopted=True))
        deadline = time.monotonic() + self.ready_timeout_s
        refs = [(h, h.actor.info.remote()) for h in handles]
        for h, ref in refs:
            try:
                h.info = ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except (ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError) as e:
                print(f"pdserve: worker {h.name} cannot be taken over ({last_line(str(e)) or 'no answer'}): its "
                      f"actor ends", file=sys.stderr, flush=True)
                self.kill(h)
                continue
            h.role = h.info["role"]
            self.workers.append(h)
        for role in self.spawned:
            self.spawned[role] = next_index(role, [h.name for h in self.workers], self.spawned[role])
        print(f"pdserve: router restarted: took over workers {', '.join(h.name for h in self.workers) or '(none)'}",
              file=sys.stderr, flush=True)

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
        """Stop every worker: each drains, then its actor ends for good."""
        self._stop_all(list(self.workers), timeout)


def next_index(role: str, names: list[str], start: int) -> int:
    """The first N >= `start` past every `ROLE-N` in `names` (the next worker's number)."""
    taken = [int(n) for name in names if (n := name.removeprefix(f"{role}-")) != name and n.isdigit()]
    return max([start, *(n + 1 for n in taken)])


def last_line(text: str) -> str:
    """The last non-empty line of an error's text (Ray's carry a traceback first)."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else text
