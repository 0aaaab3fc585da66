"""`pdserve serve`: the router (ZeroMQ + HTTP front ends) in this process, workers as
child processes. Waits until every worker has registered, prints where to connect, and on
Ctrl-C / SIGTERM stops every process it started. `pdserve router` is the same with no
workers of its own: they join it (`pdserve worker --join`, docs/deploy.md). Under
`--ray` the same `serve` runs in the router actor (router/deploy/ray_router.py), its workers Ray
actors on the cluster's nodes (router/launch/ray.py)."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import ssl
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import uvicorn

from pdserve.common.config import ConfigError
from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.common.wire.curve import resolve as resolve_curve
from pdserve.common.worker.spec import WorkerSpec
from pdserve.router.deploy.latency_auto import profiled_models
from pdserve.router.core.config import RouterConfig
from pdserve.router.pools.control import ControlPlane
from pdserve.router.core.router import Router
from pdserve.router.launch.deployment import DeploymentConfig
from pdserve.router.openai.server import OpenAIServer
from pdserve.router.launch.local import Launcher, WorkerProcess
from pdserve.router.planner.rule import PlannerConfig
from pdserve.router.planner.loop import Planner
from pdserve.router.planner.predict import LayoutModels, Predictor
from pdserve.router.pools.launch import LocalLauncher
from pdserve.router.pools.supervisor import Supervisor
from pdserve.router.core.zmq_frontend import ZmqFrontend

if TYPE_CHECKING:
    from pdserve.router.launch.ray import RayLauncher


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


def start_workers(launcher: Launcher, dep: DeploymentConfig, control: str) -> None:
    """Start every worker of `dep`, reporting to the router at `control`; shm/tcp prefill
    workers first, so decode workers can be given their bound addresses."""
    def start(spec: WorkerSpec, **late: object) -> WorkerProcess:
        return launcher.start(dataclasses.replace(spec, worker=dataclasses.replace(spec.worker, report_to=control,
                                                                                     **late)))

    prefills = [start(s) for s in dep.role("prefill")]
    for s in dep.role("colocated"):
        start(s)
    together = dep.kv_transfer in ("gloo", "nccl")  # all ranks must start before any can join the group
    if prefills and not together:
        launcher.wait_ready(prefills)
    peers = () if together else tuple(p.info["address"] for p in prefills)
    for s in dep.role("decode"):
        start(s, **({"prefill_peers": peers} if peers else {}))
    launcher.wait_ready()


async def serve(dep: DeploymentConfig, ready_file: str = "", *, stop: asyncio.Event | None = None,
                on_ready: Callable[[dict], None] | None = None, adopt: bool = False) -> None:
    """Run the deployment until `stop` is set (default: until SIGINT / SIGTERM), then stop
    its workers. Once ready, `on_ready` is given what `ready_info` says (default: it is
    printed). `adopt`: under Ray, take over the running worker actors instead of starting
    them (a router actor that Ray restarted)."""
    config = dep.router
    models = planner_models(config, dep)  # a bad latency model file: refused before any worker
    if stop is None:
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    curve = resolve_curve(config.curve, [config.control_address()], shared_secret=bool(dep.secret))
    dep = with_curve(dep, curve)  # every worker's spec, local, Ray's and those the pools add
    router = Router(config, secret=dep.secret, curve=curve)
    router.start()
    front = ZmqFrontend(router, config.zmq_address())
    front.start()
    launcher, start, stop_all = _launcher(dep, router, adopt)
    pool = _pool_launcher(dep, launcher, router)
    control = ControlPlane(router, pool, f"pdserve worker --role {{role}} --join {router.control_address} "
                                          f"--secret-file FILE {config.model_dir}")
    control.start()
    secret_file = _secret_file(launcher, dep.secret) if dep.ray is None else dep.ray.secret_file
    supervisor = (Supervisor(router, launcher, config.restart_workers, control) if dep.ray is None
                  else pool.watching(control))  # Ray restarts failed workers; RayPool ends drained ones
    http = http_task = planner = None
    try:
        http = http_server(router) if config.enable_http else None  # a bad key or cert: refused before any worker
        launch = asyncio.ensure_future(asyncio.to_thread(start))
        await _until(launch, stop)
        if stop.is_set():
            return
        launch.result()  # raises LaunchError with the worker's log tail
        if dep.ray is not None:  # a worker failing before it registers: restarted by it, or reported failed
            supervisor.start()
        if not adopt:  # adopted workers register again on their own, each when it finds this router
            await router.wait_for_workers(len(dep.prefill_devices), len(dep.decode_devices),
                                          len(dep.colocated_devices))
        if supervisor is not None and dep.ray is None:
            supervisor.start()
        planner = start_planner(control, models)
        http_url = "(disabled)"
        if http is not None:
            http_task = asyncio.create_task(http.serve())
            while not http.started:
                if http_task.done():
                    http_task.result()
                await asyncio.sleep(0.02)
            port = http.servers[0].sockets[0].getsockname()[1]
            http_url = f"{'https' if config.ssl_certfile else 'http'}://{config.host}:{port}/v1"
        info = {"http": http_url, "zmq": front.address, "control": router.control_address, "pid": os.getpid(),
                "secret_file": secret_file, "curve": curve, "zmq_server_key": front.server_key,
                "workers": {w.name: w.info for w in launcher.workers}}
        if on_ready is None:
            print(ready_text(dep, info), flush=True)
        else:
            on_ready(info)
        freeze_startup_heap()
        if ready_file:
            write_ready_file(ready_file, info)
        await stop.wait()
    finally:
        print("pdserve: stopping", file=sys.stderr, flush=True)
        if supervisor is not None:
            supervisor.close()
        if planner is not None:
            planner.close()
        control.close()
        if http_task is not None:
            http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, 5)
        front.close()
        await asyncio.to_thread(stop_all)
        await router.close()


def ready_text(dep: DeploymentConfig, info: dict) -> str:
    """What `serve` prints once ready: where to connect, given its `info`."""
    config, curve = dep.router, "on" if info["curve"] else "off"
    roles = (f"{len(dep.colocated_devices)} colocated workers" if dep.colocated_devices else
             f"{len(dep.prefill_devices)} prefill + {len(dep.decode_devices)} decode workers "
             f"(kv transfer {dep.kv_transfer})" if dep.workers else "no workers yet")
    key = info["zmq_server_key"]
    return (f"pdserve ready: {roles}, routing {config.routing}, model {config.model_dir} "
            f"({config.dtype}, quantization {config.quantization})\n"
            f"  OpenAI HTTP: {info['http']}\n  ZeroMQ:      {info['zmq']}"
            f"{f' (CurveZMQ, server key {key})' if key else ''}\n"
            f"  Workers join: {info['control']} (CurveZMQ {curve})\n"
            f"  Pools:       pdserve pools --router {info['control']} --secret-file {info['secret_file']} "
            f"--curve {curve}\n"
            f"  Ctrl-C stops everything.")


def write_ready_file(path: str, info: dict) -> None:
    """`info` as JSON at `path`, whole or not at all (written aside, then renamed)."""
    Path(path).with_suffix(".tmp").write_text(json.dumps(info))
    Path(path).with_suffix(".tmp").rename(path)


def planner_models(c: RouterConfig, dep: DeploymentConfig | None = None) -> LayoutModels | None:
    """The planner's latency models per one-host layout, where given (ConfigError if unfit);
    `auto`: profiled on this host for `dep`'s engine, or read from the cache of an earlier one."""
    if c.planner != "slo" or not c.planner_latency_models:
        return None
    paths = c.planner_latency_models
    if paths == "auto":
        if dep is None or dep.ray is not None or not dep.workers:
            raise ConfigError("--planner-latency-models auto profiles this host for `serve`'s own workers; "
                              "under Ray, or for workers that join, give the files (`pdserve profile`)")
        paths = profiled_models(dep.workers[0], c.planner_host_cores, dep.kv_transfer or "auto")
    return LayoutModels.load(paths, c.planner_host_cores)


def start_planner(control: ControlPlane, models: LayoutModels | None = None) -> Planner | None:
    """The SLO planner the router's config asks for (docs/slo.md "Planner"), started; None if none."""
    c = control.router.config
    if c.planner != "slo":
        return None
    cfg = PlannerConfig(c.slo_ttft_ms / 1000, c.slo_tpot_ms / 1000, target=c.planner_target, sustain=c.planner_sustain,
                        cooldown_s=c.planner_cooldown_s, max_workers=c.planner_max_workers,
                        host_cores=c.planner_host_cores, memory_s=c.planner_memory_s, load_band=c.planner_load_band,
                        min_requests=c.planner_min_requests, miss_z=c.planner_miss_z)
    predictor = Predictor(models, c, cfg.ttft_slo_s, cfg.tpot_slo_s, cfg.host_cores) if models else None
    planner = Planner(control, cfg, c.planner_interval_s, predictor=predictor)
    planner.start()
    return planner


def _secret_file(launcher: Launcher, given: str) -> str:
    """Where `pdserve scale` reads the deployment secret: a fresh one is written (0600) in
    the launcher's private workdir; a given one stays in the file it came from (SECRET_FILE)."""
    if given:
        return "SECRET_FILE"
    path = launcher.workdir / "secret"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(launcher.secret)
    return str(path)


def _launcher(dep: DeploymentConfig, router: Router, adopt: bool) -> tuple[Launcher | RayLauncher,
                                                                          Callable[[], None], Callable[[], None]]:
    """(launcher, start every worker, stop every worker): this machine's processes, or
    Ray's actors when Ray places the workers (router/launch/ray.py; `adopt`: those running)."""
    if dep.ray is not None:
        from pdserve.router.launch.ray import RayLauncher
        ray_launcher = RayLauncher(dep, router.control_address, adopt=adopt)
        return ray_launcher, ray_launcher.start_all, ray_launcher.close
    launcher = Launcher(secret=router.secret, curve=router.key.curve is not None)  # into each worker's 0600 config file
    return launcher, functools.partial(start_workers, launcher, dep, router.control_address), launcher.stop


def with_curve(dep: DeploymentConfig, curve: bool) -> DeploymentConfig:
    """`dep` with every worker's spec set to the deployment's CurveZMQ choice."""
    return dataclasses.replace(dep, workers=tuple(dataclasses.replace(w, worker=dataclasses.replace(w.worker, curve=curve))
                                                  for w in dep.workers))


def http_server(router: Router) -> _QuietServer:
    """The OpenAI HTTP server, over TLS when the config names a key and certificate (and,
    with CA certificates, only for clients holding a certificate they signed); ConfigError
    if those files cannot be loaded."""
    config = router.config
    tls = {"ssl_keyfile": config.ssl_keyfile, "ssl_certfile": config.ssl_certfile,
           **({"ssl_ca_certs": config.ssl_ca_certs, "ssl_cert_reqs": ssl.CERT_REQUIRED} if config.ssl_ca_certs else {})
           } if config.ssl_certfile else {}
    http = uvicorn.Config(OpenAIServer(router).app, host=config.host, port=config.http_port, loop="none",
                          log_level="warning", lifespan="off", **tls)
    try:
        http.load()
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(f"cannot serve HTTP over TLS with --ssl-keyfile {config.ssl_keyfile} --ssl-certfile "
                          f"{config.ssl_certfile}: {e}") from None
    return _QuietServer(http)


def _pool_launcher(dep: DeploymentConfig, launcher: Launcher | RayLauncher, router: Router) -> Any:
    """Who starts and stops workers for the pool control API: Ray's actors
    (router/pools/ray_pool.py's RayPool), this machine's processes, or none (`pdserve router`)."""
    if dep.ray is not None:
        from pdserve.router.pools.ray_pool import RayPool
        return RayPool(launcher)
    return LocalLauncher(launcher, dep, router.control_address) if dep.workers else None


async def _until(fut: asyncio.Future, stop: asyncio.Event) -> None:
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


def run(dep: DeploymentConfig, ready_file: str = "") -> None:
    import uvloop
    uvloop.run(serve(dep, ready_file))
