"""Moving KV blocks between workers: backends (shm, cuda_ipc, gloo, nccl, tcp) behind one
sender/receiver interface, chosen by name or by device with `auto`."""
from __future__ import annotations

import torch

from pdserve.common.config import BACKENDS, ConfigError, WorkerConfig
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.common.worker.host import resolve_backend  # re-exported: its home is common.worker.host (the router names backends without torch)
from pdserve.common.engine.kv_layout import layout_mismatch, layout_of  # re-exported: their home is common.engine.kv_layout
from pdserve.kv_transfer.base import KVReceiver, KVSender, PendingReceive, TransferError
from pdserve.kv_transfer.peer_check import check_block_ids, check_peer_info, shm_name_hint

__all__ = ["BACKENDS", "KVReceiver", "KVSender", "PendingReceive", "TransferError", "check_block_ids",
           "check_peer_info", "init_transfer_group", "shm_name_hint",
           "layout_mismatch", "layout_of", "make_receiver", "make_sender", "resolve_backend"]


def init_transfer_group(worker_config: WorkerConfig, device: str = "cpu") -> None:
    """Join the deployment's torch.distributed group when the backend needs one (gloo,
    nccl); a no-op for the others. Every P and D of a gloo/nccl deployment calls this at
    start-up, before writing its ready file: the group forms only once all ranks are in.
    `device`: the worker's device, which an NCCL group binds to."""
    w = worker_config
    if w.kv_transfer in ("gloo", "nccl"):
        from pdserve.kv_transfer.torch_dist import init_group
        try:
            init_group(w.kv_transfer, w.dist_init, w.rank, w.world_size, device)
        except RuntimeError as e:  # torch's DistBackendError and DistNetworkError among them
            reason = [line for line in str(e).splitlines() if line.strip()]
            raise ConfigError(f"kv transfer {w.kv_transfer}: rank {w.rank} of {w.world_size} on {device} could not "
                              f"join the group at {w.dist_init}: {reason[-1] if reason else type(e).__name__}") from None


def make_receiver(backend: str, shape: tuple[int, ...], dtype: torch.dtype, device: str,
                  name_hint: str) -> KVReceiver:
    """The decode side: allocates the KV cache where the backend needs it."""
    if backend == "shm":
        from pdserve.kv_transfer.shm import ShmReceiver
        return ShmReceiver(shape, dtype, name_hint)
    cache = kv_cache_tensor(shape, dtype, device)
    if backend == "cuda_ipc":
        from pdserve.kv_transfer.cuda_ipc import CudaIpcReceiver
        return CudaIpcReceiver(cache)
    if backend in ("gloo", "nccl"):
        from pdserve.kv_transfer.torch_dist import DistReceiver
        return DistReceiver(cache, backend)
    from pdserve.kv_transfer.tcp import TcpReceiver
    return TcpReceiver(cache)


def make_sender(backend: str, kv_cache: torch.Tensor, peer_info: dict) -> KVSender:
    if backend == "shm":
        from pdserve.kv_transfer.shm import ShmSender
        return ShmSender(kv_cache, peer_info)
    if backend == "cuda_ipc":
        from pdserve.kv_transfer.cuda_ipc import CudaIpcSender
        return CudaIpcSender(kv_cache, peer_info)
    if backend in ("gloo", "nccl"):
        from pdserve.kv_transfer.torch_dist import DistSender
        return DistSender(kv_cache, peer_info, backend)
    from pdserve.kv_transfer.tcp import TcpSender
    return TcpSender(kv_cache, peer_info)
