"""`pdserve serve` (router and workers on this machine, or on Ray), `pdserve router` (the
router alone) and `pdserve worker --join` (one worker joining a router)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from pdserve.common.config import (ConfigError, WorkerConfig)
from pdserve.router.cli.flags import (WORKER_DEST, engine_options, given, resolved_options, router_config,
                                      secret_of)
from pdserve.router.cli.ray import ray_placement, serve_with_ray


def _devices(spec: str | None, count: int, flag: str, default: str = "cpu") -> tuple[str, ...]:
    """`--prefill 2 --prefill-devices cuda:0,cuda:1`; `default` (--device) for all when no
    devices are given."""
    if not spec:
        return (default,) * count
    devs = tuple(d.strip() for d in spec.split(",") if d.strip())
    if len(devs) != count:
        raise ConfigError(f"{flag} lists {len(devs)} devices for {count} workers")
    return devs


def _worker_devices(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each role's workers' devices: the role's --*-devices flag, else --device for all."""
    default = engine_options(args).device.device
    if args.colocated:
        return {"colocated": _devices(args.colocated_devices, args.colocated, "--colocated-devices", default)}
    return {"prefill": _devices(args.prefill_devices, args.prefill, "--prefill-devices", default),
            "decode": _devices(args.decode_devices, args.decode, "--decode-devices", default)}


def cmd_serve(args: argparse.Namespace) -> int:
    """Fill the DeploymentConfig once from the flags, then run it."""
    from pdserve.router.launch.deployment import plan_deployment
    from pdserve.router.deploy.local import run
    placement = ray_placement(args)  # None: every worker on this machine
    if args.colocated and (args.prefill or args.decode):
        raise ConfigError("use either --colocated K or --prefill N --decode M, not both")
    if not args.colocated:
        args.prefill = 1 if args.prefill is None else args.prefill
        args.decode = 1 if args.decode is None else args.decode
    if not args.colocated and (args.prefill < 1 or args.decode < 1):
        raise ConfigError("a disaggregated deployment needs --prefill >= 1 and --decode >= 1 (or --colocated K)")
    devices = _worker_devices(args)
    model, options = resolved_options(args, here=placement is None,
                                       workers_device=next((d for ds in devices.values() for d in ds if d != "cpu"), None))
    n_workers = args.colocated or (args.prefill + args.decode)
    threads = options.device.num_threads or max(1, (os.cpu_count() or 1) // n_workers)
    if placement is not None:
        return serve_with_ray(args, placement, model, options)
    # admission: every decode-side worker's batch, 4 times over (queued on the workers included)
    max_inflight = args.max_inflight or 4 * options.scheduler.max_num_seqs * (args.colocated or args.decode)
    router = router_config(args, model, options, max_inflight, restart_workers=args.restart)
    timeouts = given(args, WORKER_DEST)
    if args.colocated:
        dep = plan_deployment(router, options, threads_per_worker=threads, worker_timeouts=timeouts,
                              colocated_devices=devices["colocated"])
    else:
        dep = plan_deployment(router, options, kv_transfer=args.kv_transfer, threads_per_worker=threads,
                              worker_timeouts=timeouts, prefill_devices=devices["prefill"],
                              decode_devices=devices["decode"])
    if args.secret_file:  # multi-host: every host's workers are given the same secret this way
        dep = dataclasses.replace(dep, secret=secret_of(args.secret_file))
    run(dep, args.ready_file)
    return 0


def cmd_router(args: argparse.Namespace) -> int:
    """The router and its front ends alone; workers join it (`pdserve worker --join`)."""
    from pdserve.router.launch.deployment import DeploymentConfig
    from pdserve.router.deploy.local import run
    model, options = resolved_options(args)
    max_inflight = args.max_inflight or 4 * options.scheduler.max_num_seqs
    router = router_config(args, model, options, max_inflight)
    run(DeploymentConfig(router, (), secret=secret_of(args.secret_file)), args.ready_file)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    """One worker that registers with the router at --join; it runs in this process."""
    import socket

    from pdserve.common.worker.spec import WorkerSpec
    from pdserve.common.worker.host import pair_transport
    from pdserve.common.worker.router_link import EXIT_ROUTER_LOST, RouterLost
    from pdserve.common.wire.curve import resolve as resolve_curve
    from pdserve.common.wire.transport import is_endpoint
    if not is_endpoint(args.join) or not args.join.startswith("tcp://"):
        raise ConfigError(f"--join must be the router's control address, tcp://HOST:PORT, got {args.join!r}")
    model, options = resolved_options(args)
    # a joined worker's peers may be on any host, so `auto` is tcp here (common/worker/host.py)
    kv_transfer = "auto" if args.role == "colocated" else pair_transport(args.kv_transfer, options.device.device, None)
    worker_id = args.name or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    wconfig = WorkerConfig(role=args.role, worker_id=worker_id, bind=f"tcp://{args.host}:{args.port}",
                           kv_transfer=kv_transfer, report_to=args.join, host_id=args.host_id,
                           secret=secret_of(args.secret_file), ready_file=args.ready_file,
                           curve=resolve_curve(args.curve, [args.join], shared_secret=True),
                           **given(args, WORKER_DEST))
    spec = WorkerSpec(model, options, wconfig)
    print(f"pdserve worker {worker_id}: {args.role}, kv transfer {kv_transfer}, joining {args.join}, "
          f"CurveZMQ {'on' if wconfig.curve else 'off'}",
          file=sys.stderr, flush=True)
    if args.role == "prefill":
        from pdserve.prefill_node.worker import serve
    else:
        from pdserve.decode_node.serve import serve
    try:
        serve(spec.engine_config(), spec.worker)
    except RouterLost:  # the worker has logged why
        return EXIT_ROUTER_LOST
    return 0
