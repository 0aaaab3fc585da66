"""The router as a detached Ray actor (`pdserve serve --ray`, docs/deploy.md "A Ray
cluster"), and the driver that starts and ends it.

The driver connects to the cluster and places the router actor -- named `pdserve-router`
in the deployment's Ray namespace, detached (owned by the cluster, not by the driver),
restarted by Ray whenever it dies -- on one node (`--router-resources`, default: the
head node); it prints where the router serves and waits. On Ctrl-C / SIGTERM the router
drains and ends every worker actor, then the driver ends every actor named in the
namespace: nothing of the deployment is left in the cluster.

The router actor runs router/deploy/local.py's `serve` in a thread of its own. It starts the
worker actors (detached too, router/launch/ray.py) or, when Ray has restarted it, takes
over those still running, by their names. The workers notice a dead router by its silence,
give up its requests and say hello to the restarted one (common/worker/router_link.py),
so it must come back at the same address: the actor is pinned to the node it was first
placed on, and its ports are fixed before it starts (a port given as 0 is picked once, on
that node, by a probe task) and passed in its arguments, which Ray gives every restart.

If the driver dies instead, the actors keep serving; `pdserve ray-stop` ends them."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import sys
import threading
import time
import warnings
from typing import Any

from pdserve.common.config import ConfigError
from pdserve.common.wire.auth import read_secret_file
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.deployment import DeploymentConfig, RayPlacement
from pdserve.router.launch.local import LaunchError
from pdserve.router.launch.ray import READY_TIMEOUT_S, ROUTER_ACTOR, connect, import_ray, last_line
from pdserve.router.deploy.local import ready_text, serve, write_ready_file

HEAD_NODE = {"node:__internal_head__": 0.001}  # Ray's resource of the head node alone
STOP_TIMEOUT_S = 60.0  # the router's stop: every worker drains (drain_s), then the actors end
RESTART_PAUSE_S = 2.0  # a restarted router that cannot serve exits after this, for Ray to try again
POLL_S = 0.5  # how often the driver looks for a signal while it waits on Ray


class RouterActor:
    """One deployment's router: its front ends, control plane and worker actors
    (router/deploy/local.py's `serve`, in a thread of this actor). Owns that thread and the
    event that stops it. `dep` carries no secret: the actor reads the secret file."""

    def __init__(self, dep: DeploymentConfig) -> None:
        import ray
        assert dep.ray is not None
        with warnings.catch_warnings():  # Ray's own property reads a deprecated one of its context
            warnings.simplefilter("ignore", DeprecationWarning)
            self.restarted = bool(ray.get_runtime_context().was_current_actor_reconstructed)
        try:
            secret = read_secret_file(dep.ray.secret_file)
        except ValueError as e:
            raise ConfigError(f"{e} (the secret file must be present at this path on the router's node)") from None
        self.dep = dataclasses.replace(dep, secret=secret)
        self.node_id = ray.get_runtime_context().get_node_id()
        self.info: dict | None = None
        self.error = ""
        self._ready = threading.Event()  # set once it serves, or once it failed
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="router", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return "PdserveRouter"

    def _run(self) -> None:
        import uvloop

        async def run() -> None:  # not a method: an actor with a coroutine method is an asyncio actor
            self._loop, self._stop = asyncio.get_running_loop(), asyncio.Event()
            if self._stopping:  # `stop` came before the loop was up
                self._stop.set()
            await serve(self.dep, stop=self._stop, on_ready=self._on_ready, adopt=self.restarted)

        try:
            uvloop.run(run())
        except BaseException as e:  # told to the driver, or Ray restarts this actor
            self.error = f"{type(e).__name__}: {e}"
        finally:
            self._ready.set()
        if self._stopping or (self.info is None and not self.restarted):
            return  # stopped, or a first start that failed: the driver, waiting in `ready`, ends this actor
        print(f"pdserve: the router stopped unasked ({self.error or 'its loop ended'}): Ray starts it again",
              file=sys.stderr, flush=True)
        time.sleep(RESTART_PAUSE_S)
        os._exit(1)

    def _on_ready(self, info: dict) -> None:
        self.info = dict(info, router={"node_id": self.node_id, "pid": os.getpid(), "restarted": self.restarted})
        self._ready.set()

    def ready(self, timeout_s: float) -> dict:
        """Where the router serves and its workers, once it serves (router/deploy/local.py's
        ready info, with `router`: its node, pid and whether Ray restarted it).
        LaunchError saying why if it failed to start, or is not ready in time."""
        if not self._ready.wait(timeout_s):
            raise LaunchError(f"the router is not ready after {timeout_s:.0f} s")
        if self.info is None:
            raise LaunchError(self.error or "the router stopped before it was ready")
        return self.info

    def stop(self, timeout_s: float) -> bool:
        """Stop the router: every worker drains and its actor ends for good. Whether it
        ended within `timeout_s`."""
        self._stopping = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def router_options(resources: dict[str, float]) -> dict[str, Any]:
    """Ray's options placing the router (and its probe): `--router-resources` (default:
    the head node), no CPU or GPU unless they name one."""
    custom = dict(resources or HEAD_NODE)
    options: dict[str, Any] = dict(num_cpus=custom.pop("CPU", 0.0), num_gpus=custom.pop("GPU", 0.0))
    if "memory" in custom:
        options["memory"] = custom.pop("memory")
    return dict(options, resources=custom)


def probe(count: int) -> tuple[str, str, list[int]]:
    """Run on the router's node: its node id, its address and `count` distinct ports
    free there now."""
    import ray
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("", 0))
        ports = [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()
    return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), ports


def fixed_address(config: RouterConfig, host: str, free: list[int]) -> RouterConfig:
    """`config` bound at `host`, every port given as 0 taken from `free` (the HTTP port
    only when HTTP is on): the address a restarted router comes back at."""
    ports = iter(free)
    fields = {name: next(ports) for name in ("zmq_port", "control_port", "http_port")
              if getattr(config, name) == 0 and (name != "http_port" or config.enable_http)}
    return dataclasses.replace(config, host=host, **fields)


def start_router(ray: Any, dep: DeploymentConfig, bind_node_address: bool) -> Any:
    """Place the router actor: on a node with the router's resources, pinned there, at
    fixed ports (`bind_node_address`: bound at that node's address, else at the
    configured host). Returns its handle; `ready` says when it serves."""
    placement: RayPlacement = dep.ray
    options = router_options(placement.resources.get("router", {}))
    ref = ray.remote(probe).options(**options).remote(3)
    try:
        node_id, address, free = ray.get(ref, timeout=READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise LaunchError(f"no Ray node has the router's resources {options['resources']} after "
                          f"{READY_TIMEOUT_S:.0f} s (--router-resources; `ray status` shows the cluster's)") from None
    config = fixed_address(dep.router, address if bind_node_address else dep.router.host, free)
    pinned = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node_id, soft=False)
    actor_class = ray.remote(RouterActor).options(
        name=ROUTER_ACTOR, namespace=placement.namespace, lifetime="detached", max_restarts=-1, max_task_retries=0,
        max_concurrency=4, scheduling_strategy=pinned, **options)
    return actor_class.remote(dataclasses.replace(dep, router=config, secret=""))


def named_actors(ray: Any, namespace: str) -> list[str]:
    """The names of the live actors named in `namespace`."""
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)


def end_deployment(ray: Any, namespace: str, stop_timeout_s: float = STOP_TIMEOUT_S) -> list[str]:
    """End the deployment in `namespace`: its router drains and ends its workers; then
    every actor still named there ends (the router's, and workers it could not end).
    Returns their names."""
    try:
        router = ray.get_actor(ROUTER_ACTOR, namespace=namespace)
    except ValueError:
        router = None
    if router is not None:
        try:
            ray.get(router.stop.remote(stop_timeout_s), timeout=stop_timeout_s + 10)
        except ray.exceptions.RayError as e:
            print(f"pdserve: the router did not stop its workers ({last_line(str(e))}): their actors end now",
                  file=sys.stderr, flush=True)
    names = named_actors(ray, namespace)
    for name in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except (ValueError, ray.exceptions.RayError):
            pass  # ended meanwhile
    deadline = time.monotonic() + 10.0
    while named_actors(ray, namespace) and time.monotonic() < deadline:
        time.sleep(0.1)
    return names


def _get(ray: Any, ref: Any, stop: threading.Event) -> Any:
    """`ray.get(ref)`, given up (None) once `stop` is set."""
    while not stop.is_set():
        done, _ = ray.wait([ref], timeout=POLL_S)
        if done:
            return ray.get(done[0])
    return None


def serve_on_ray(dep: DeploymentConfig, ready_file: str = "", bind_node_address: bool = True) -> None:
    """`pdserve serve --ray`: start the router actor (which starts the workers), print
    where it serves, wait for Ctrl-C / SIGTERM, then end the deployment. ConfigError
    when the namespace already holds a deployment; LaunchError when it cannot start."""
    assert dep.ray is not None
    ray, placement = import_ray(), dep.ray
    connect(placement)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        taken = named_actors(ray, placement.namespace)
        if taken:
            raise ConfigError(f"Ray namespace {placement.namespace!r} already holds actors {', '.join(taken)}: a "
                              f"deployment runs there; end it with `pdserve ray-stop --ray {placement.address} "
                              f"--ray-namespace {placement.namespace}`, or give this one another --ray-namespace")
        _serve(ray, dep, ready_file, bind_node_address, stop)
    except ConfigError:
        ray.shutdown()
        raise
    except BaseException:
        _end(ray, placement.namespace)
        raise
    _end(ray, placement.namespace)


def _serve(ray: Any, dep: DeploymentConfig, ready_file: str, bind_node_address: bool, stop: threading.Event) -> None:
    router = start_router(ray, dep, bind_node_address)
    try:
        info = _get(ray, router.ready.remote(READY_TIMEOUT_S + 60), stop)
    except ray.exceptions.RayError as e:
        raise LaunchError(f"the router actor failed to start: {last_line(str(e))}") from None
    if info is None:
        return
    info["pid"] = os.getpid()  # the driver's: SIGINT / SIGTERM to it ends the deployment
    print(ready_text(dep, info) + f"\n  Router:      Ray actor {ROUTER_ACTOR} (namespace {dep.ray.namespace}) on "
          f"node {info['router']['node_id']}; Ray restarts it there, the workers rejoin it", flush=True)
    if ready_file:
        write_ready_file(ready_file, info)
    stop.wait()


def _end(ray: Any, namespace: str) -> None:
    print("pdserve: stopping", file=sys.stderr, flush=True)
    try:
        end_deployment(ray, namespace)
    finally:
        ray.shutdown()


def ray_stop(placement: RayPlacement) -> list[str]:
    """`pdserve ray-stop`: end the deployment in `placement.namespace` (one whose driver
    died: its actors kept serving). Returns the names of the actors ended."""
    ray = import_ray()
    connect(placement)
    try:
        return end_deployment(ray, placement.namespace)
    finally:
        ray.shutdown()
