"""One deployment as data: the router's config and every worker's spec (model, engine
options, worker config), filled once by `pdserve serve` and handed to the launcher."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.config import ConfigError, EngineOptions, WorkerConfig
from pdserve.common.worker.spec import WorkerSpec
from pdserve.common.worker.host import resolve_backend
from pdserve.router.core.config import RouterConfig
from pdserve.router.launch.local import free_port


@dataclass(frozen=True)
class RayPlacement:
    """Where the router and the workers run when Ray places them (`serve --ray`,
    router/deploy/ray_router.py, router/launch/ray.py): the cluster's address, the Ray resources
    one worker of each role needs (and the router, under "router"), the path of the secret
    file (present on every node; the secret itself never goes through Ray) and the Ray
    namespace the deployment's actors are named in."""

    address: str  # "auto" (the cluster this machine belongs to) or the head's HOST:PORT
    # role ("prefill", "decode", "router") -> {"prefill_pool": 1, "CPU": 2}
    resources: dict[str, dict[str, float]] = field(default_factory=dict)
    secret_file: str = ""
    namespace: str = "pdserve"


@dataclass(frozen=True)
class DeploymentConfig:
    """The router's config and one WorkerSpec per worker process, prefill workers first.

    What only exists at run time is left empty here and filled by `router.serve.
    start_workers`: each worker's `report_to` (the router's bound control socket) and a
    decode worker's `prefill_peers` (the prefill workers' bound addresses)."""

    router: RouterConfig
    workers: tuple[WorkerSpec, ...]
    kv_transfer: str = ""  # the resolved backend; "" for a colocated deployment
    secret: str = field(default="", repr=False)  # common.wire.auth; "" = a fresh one per `serve` (single host)
    ray: RayPlacement | None = None  # Ray places and restarts the workers; None: this machine's processes

    def __post_init__(self) -> None:
        for w in self.workers:  # the router routes by prefix hashes of its own block size and model
            if w.engine.cache.block_size != self.router.block_size:
                raise ConfigError(f"worker {w.worker.worker_id} has block_size {w.engine.cache.block_size}, "
                                  f"the router {self.router.block_size}")
            if w.model_dir != self.router.model_dir:
                raise ConfigError(f"worker {w.worker.worker_id} serves {w.model_dir}, the router {self.router.model_dir}")

    def role(self, role: str) -> tuple[WorkerSpec, ...]:
        return tuple(w for w in self.workers if w.worker.role == role)

    @property
    def prefill_devices(self) -> tuple[str, ...]:
        return tuple(w.engine.device.device for w in self.role("prefill"))

    @property
    def decode_devices(self) -> tuple[str, ...]:
        return tuple(w.engine.device.device for w in self.role("decode"))

    @property
    def colocated_devices(self) -> tuple[str, ...]:
        return tuple(w.engine.device.device for w in self.role("colocated"))


def check_one_rank_per_gpu(devices: tuple[str, ...]) -> None:
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected", seen on an H100):
    refuse such an nccl deployment before starting anything."""
    seen: dict[str, int] = {}
    for dev in devices:
        key = dev if ":" in dev else f"{dev}:0"  # "cuda" is cuda:0 in a fresh worker process
        seen[key] = seen.get(key, 0) + 1
    shared = sorted(k for k, n in seen.items() if n > 1)
    if shared:
        raise ConfigError(f"kv transfer nccl needs one GPU per worker, but {', '.join(shared)} would hold "
                          f"several (NCCL refuses two ranks on one device); give each worker its own GPU, "
                          f"or use --kv-transfer cuda_ipc to share one")


def plan_deployment(router: RouterConfig, engine: EngineOptions, *, prefill_devices: tuple[str, ...] = (),
                    decode_devices: tuple[str, ...] = (), colocated_devices: tuple[str, ...] = (),
                    kv_transfer: str = "auto", threads_per_worker: int = 1,
                    worker_timeouts: dict[str, float | bool] | None = None) -> DeploymentConfig:
    """Every worker's spec: `engine` with the worker's device and thread count; P/D ranks
    0..P+D-1 (prefill first) and a free loopback port to form the group on when the
    backend is gloo or nccl. `worker_timeouts`: WorkerConfig's liveness fields
    (heartbeat_s, peer_timeout_s, router_timeout_s, lease_s, drain_s, verify_transfers)
    for every worker."""
    if colocated_devices and (prefill_devices or decode_devices):
        raise ConfigError("a deployment is either colocated or prefill/decode, not both")

    def spec(role: str, name: str, device: str, **worker: object) -> WorkerSpec:
        options = engine.replace(device=device, num_threads=threads_per_worker)
        return WorkerSpec(router.model_dir, options, WorkerConfig(role=role, worker_id=name, **worker,
                                                                           **(worker_timeouts or {})))  # type: ignore[arg-type]

    if colocated_devices:
        workers = tuple(spec("colocated", f"colocated-{i}", dev) for i, dev in enumerate(colocated_devices))
        return DeploymentConfig(router, workers)
    try:
        backend = resolve_backend(kv_transfer, prefill_devices[0] if prefill_devices else "cpu")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if backend == "nccl":
        check_one_rank_per_gpu((*prefill_devices, *decode_devices))
    world = len(prefill_devices) + len(decode_devices)
    ranks = iter(range(world)) if backend in ("gloo", "nccl") else None
    dist_init = f"tcp://{router.host}:{free_port()}" if ranks is not None else ""  # rank 0's store binds there

    def dist() -> dict:
        return {"dist_init": dist_init, "rank": next(ranks), "world_size": world} if ranks is not None else {}

    workers = (*(spec("prefill", f"prefill-{i}", dev, kv_transfer=backend, **dist())
                 for i, dev in enumerate(prefill_devices)),
               *(spec("decode", f"decode-{j}", dev, kv_transfer=backend, **dist())
                 for j, dev in enumerate(decode_devices)))
    return DeploymentConfig(router, workers, backend)
