"""`pdserve serve --ray` and `pdserve ray-stop`: the Ray flags, their checks, and the
deployment on a Ray cluster. Ray and the modules that import it load only when a Ray
command runs, so pdserve runs without Ray installed."""
from __future__ import annotations

import argparse
import dataclasses
import typing
from pathlib import Path

from pdserve.common.config import ConfigError, EngineOptions

if typing.TYPE_CHECKING:
    from pdserve.router.launch.deployment import RayPlacement


def add_ray_flags(p: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """`serve`'s Ray flags; returns their group."""
    g = p.add_argument_group("Ray: place and restart the workers on a Ray cluster (docs/deploy.md)")
    g.add_argument("--ray", default=None, metavar="auto|ADDRESS",
                   help="run each worker as a Ray actor on the cluster (auto: the one this machine belongs to)")
    g.add_argument("--prefill-resources", default=None, metavar="JSON",
                   help='Ray resources one prefill worker needs, e.g. \'{"prefill_pool": 1}\' (custom ones too; '
                        "default: CPU = its threads, GPU = 1 with --device cuda)")
    g.add_argument("--decode-resources", default=None, metavar="JSON", help="the same for one decode worker")
    g.add_argument("--router-resources", default=None, metavar="JSON", dest="ray_router_resources",  # not a RouterConfig field
                   help="Ray resources that place the router actor, on one node (default: the head node)")
    g.add_argument("--ray-namespace", default="pdserve", help="the Ray namespace the deployment's actors are named in")
    return g


def add_ray_stop_parser(sub: argparse._SubParsersAction) -> None:
    """The `ray-stop` command."""
    p = sub.add_parser("ray-stop", help="end a `serve --ray` deployment whose driver is gone (docs/deploy.md)")
    p.add_argument("--ray", required=True, metavar="auto|ADDRESS", help="the Ray cluster")
    p.add_argument("--ray-namespace", default="pdserve", help="the deployment's Ray namespace")
    p.set_defaults(func=cmd_ray_stop)


def ray_placement(args: argparse.Namespace) -> "RayPlacement | None":
    """`serve --ray` and its flags, checked; None without --ray."""
    from pdserve.router.launch.deployment import RayPlacement
    from pdserve.router.launch.ray import parse_resources
    resources = {"prefill": args.prefill_resources, "decode": args.decode_resources, "router": args.ray_router_resources}
    if not args.ray:
        if any(v is not None for v in resources.values()):
            raise ConfigError("--prefill-resources / --decode-resources / --router-resources place actors with Ray: "
                              "give --ray auto|ADDRESS")
        return None
    if args.colocated:
        raise ConfigError("--ray places prefill and decode workers (--prefill N --decode M), not colocated ones")
    if args.prefill_devices or args.decode_devices:
        raise ConfigError("--prefill-devices / --decode-devices do not apply under --ray: Ray gives each GPU "
                          "worker one GPU of its node (--device cuda)")
    if args.restart:
        raise ConfigError("--restart is for workers on this machine: under --ray, Ray restarts them")
    if args.kv_transfer in ("gloo", "nccl"):
        raise ConfigError(f"--kv-transfer {args.kv_transfer} needs a group fixed at start, which a worker Ray "
                          f"restarts cannot rejoin: under --ray use tcp (auto)")
    if not args.secret_file:
        raise ConfigError("--ray needs --secret-file: a file (mode 0600) at that path on every Ray node "
                          "(the secret never travels through Ray)")
    return RayPlacement(args.ray, {role: parse_resources(text or "{}", f"--{role}-resources")
                                   for role, text in resources.items()},
                        str(Path(args.secret_file).resolve()), args.ray_namespace)


def serve_with_ray(args: argparse.Namespace, placement: "RayPlacement", model: str, options: EngineOptions) -> int:
    """`serve --ray`: the router a Ray actor on the router's node (router/deploy/ray_router.py),
    bound to that node's address unless --host says otherwise; each worker a Ray actor on
    a node with its role's resources, its KV transfer tcp unless another is asked for (its
    peers may be on any node)."""
    from pdserve.common.worker.host import pair_transport
    from pdserve.router.cli.flags import ROUTER_DEST, WORKER_DEST, given, router_config, secret_of
    from pdserve.router.launch.deployment import plan_deployment
    from pdserve.router.deploy.ray_router import serve_on_ray
    device = options.device.device
    if device.startswith("cuda:"):
        raise ConfigError(f"--device {device}: under --ray, Ray picks each worker's GPU; give --device cuda")
    secret_of(args.secret_file)  # checked here: the router actor reads the same file on its node
    model = str(Path(model).resolve())  # the same path on every node
    max_inflight = args.max_inflight or 4 * options.scheduler.max_num_seqs * args.decode
    router = router_config(args, model, options, max_inflight)
    dep = plan_deployment(router, options, kv_transfer=pair_transport(args.kv_transfer, device, None),
                          threads_per_worker=options.device.num_threads or 1, worker_timeouts=given(args, WORKER_DEST),
                          prefill_devices=(device,) * args.prefill, decode_devices=(device,) * args.decode)
    serve_on_ray(dataclasses.replace(dep, ray=placement), args.ready_file,
                 bind_node_address=ROUTER_DEST + "host" not in vars(args))
    return 0


def cmd_ray_stop(args: argparse.Namespace) -> int:
    """End the `serve --ray` deployment in a Ray namespace (its driver died; its actors serve on)."""
    from pdserve.router.launch.deployment import RayPlacement
    from pdserve.router.deploy.ray_router import ray_stop
    ended = ray_stop(RayPlacement(args.ray, namespace=args.ray_namespace))
    print(f"pdserve: ended {', '.join(ended)}" if ended else f"pdserve: no actors in Ray namespace {args.ray_namespace!r}")
    return 0
