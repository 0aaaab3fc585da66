"""`pdserve serve`: the router (ZeroMQ + HTTP front ends) in this process, workers as
child processes. Waits until every worker has registered, prints where to connect, and on
Ctrl-C / SIGTERM stops every process it started."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import uvicorn

from common.launch import Launcher, free_port
from router.config import RouterConfig
from router.core import Router
from router.http_server import create_app
from router.zmq_frontend import ZmqFrontend


@dataclass(frozen=True)
class Deployment:
    """How many workers of each role, where they run and how KV moves between them."""

    prefill_devices: tuple[str, ...]
    decode_devices: tuple[str, ...]
    colocated_devices: tuple[str, ...]
    kv_transfer: str = "auto"
    threads_per_worker: int = 1
    worker_options: tuple[str, ...] = ()  # engine flags passed to every worker


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: this process stops it."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield

    def install_signal_handlers(self) -> None:
        pass


def _kv_backend(name: str, devices: tuple[str, ...]) -> str:
    from kv_transfer import resolve_backend
    return resolve_backend(name, devices[0] if devices else "cpu")


def start_workers(launcher: Launcher, model_dir: str, dep: Deployment, control: str) -> None:
    base = [*dep.worker_options, "--report-to", control, "--num-threads", str(dep.threads_per_worker)]
    if dep.colocated_devices:
        for i, dev in enumerate(dep.colocated_devices):
            launcher.start(f"colocated-{i}", "colocated", model_dir, [*base, "--device", dev])
        launcher.wait_ready()
        return
    backend = _kv_backend(dep.kv_transfer, dep.prefill_devices)
    base += ["--kv-transfer", backend]
    dist: list[list[str]] = []
    world = len(dep.prefill_devices) + len(dep.decode_devices)
    if backend in ("gloo", "nccl"):
        init = f"tcp://127.0.0.1:{free_port()}"
        dist = [["--dist-init", init, "--rank", str(r), "--world-size", str(world)] for r in range(world)]
    prefills = [launcher.start(f"prefill-{i}", "prefill", model_dir,
                               [*base, "--device", dev, *(dist[i] if dist else [])])
                for i, dev in enumerate(dep.prefill_devices)]
    if not dist:  # gloo/nccl ranks must all start before any can finish joining the group
        launcher.wait_ready(prefills)
    peers = ",".join(p.info["address"] for p in prefills) if not dist else ""
    for j, dev in enumerate(dep.decode_devices):
        extra = dist[len(prefills) + j] if dist else ["--prefill-peers", peers]
        launcher.start(f"decode-{j}", "decode", model_dir, [*base, "--device", dev, *extra])
    launcher.wait_ready()


async def serve(config: RouterConfig, dep: Deployment, ready_file: str = "") -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    router = Router(config)
    router.start()
    front = ZmqFrontend(router, config.zmq_address())
    front.start()
    launcher = Launcher()
    http = http_task = None
    try:
        launch = asyncio.ensure_future(asyncio.to_thread(start_workers, launcher, config.model_dir, dep,
                                                         router.control_address))
        await _until(launch, stop)
        if stop.is_set():
            return
        launch.result()  # raises LaunchError with the worker's log tail
        await router.wait_for_workers(len(dep.prefill_devices), len(dep.decode_devices), len(dep.colocated_devices))
        http_url = "(disabled)"
        if config.enable_http:
            http = _QuietServer(uvicorn.Config(create_app(router), host=config.host, port=config.http_port,
                                               loop="none", log_level="warning", lifespan="off"))
            http_task = asyncio.create_task(http.serve())
            while not http.started:
                if http_task.done():
                    http_task.result()
                await asyncio.sleep(0.02)
            port = http.servers[0].sockets[0].getsockname()[1]
            http_url = f"http://{config.host}:{port}/v1"
        roles = (f"{len(dep.colocated_devices)} colocated" if dep.colocated_devices else
                 f"{len(dep.prefill_devices)} prefill + {len(dep.decode_devices)} decode "
                 f"(kv transfer {_kv_backend(dep.kv_transfer, dep.prefill_devices)})")
        print(f"pdserve ready: {roles} workers, routing {config.routing}, model {config.model_dir}\n"
              f"  OpenAI HTTP: {http_url}\n  ZeroMQ:      {front.address}\n  Ctrl-C stops everything.",
              flush=True)
        if ready_file:
            info = {"http": http_url, "zmq": front.address, "pid": os.getpid(),
                    "workers": {w.name: w.info for w in launcher.workers}}
            Path(ready_file).with_suffix(".tmp").write_text(json.dumps(info))
            Path(ready_file).with_suffix(".tmp").rename(ready_file)
        await stop.wait()
    finally:
        print("pdserve: stopping", file=sys.stderr, flush=True)
        if http is not None:
            http.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(http_task, 5)
        front.close()
        await asyncio.to_thread(launcher.stop)
        await router.close()


async def _until(fut: asyncio.Future, stop: asyncio.Event) -> None:
    waiter = asyncio.ensure_future(stop.wait())
    await asyncio.wait([fut, waiter], return_when=asyncio.FIRST_COMPLETED)
    waiter.cancel()


def run(config: RouterConfig, dep: Deployment, ready_file: str = "") -> None:
    import uvloop
    uvloop.run(serve(config, dep, ready_file))
