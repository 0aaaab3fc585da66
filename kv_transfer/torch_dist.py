"""Transfer over torch.distributed point-to-point: gloo on CPU, NCCL on GPU, same code.
P gathers the blocks into one contiguous buffer and `isend`s it; D, on the KVReady that
precedes the data, posts the matching `recv` and scatters into its reserved blocks.
Each P/D pair keeps FIFO order, so the n-th KVReady matches the n-th send."""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from common.config import parse_dtype
from common.messages import KVReady
from kv_transfer.base import KVReceiver, KVSender, TransferError, dtype_name, gather_kv, scatter_kv


def init_group(backend: str, init_method: str, rank: int, world_size: int) -> None:
    """Join the transfer process group (every P and D of a deployment, ranks by launcher)."""
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))


class DistReceiver(KVReceiver):
    def __init__(self, kv_cache: torch.Tensor, backend: str) -> None:
        super().__init__(kv_cache)
        self.backend = backend

    def backend_info(self) -> dict:
        return {"rank": dist.get_rank()}

    def receive(self, ready: KVReady, frames: list[bytes], dst_blocks: list[int], peer: dict) -> None:
        super().receive(ready, frames, dst_blocks, peer)
        want = self.expected_shape(len(dst_blocks))
        if ready.payload_shape != want or ready.payload_dtype != dtype_name(self.kv_cache.dtype):
            # the data is on its way regardless: drain it so the pair stays in step
            try:
                sink_dtype = parse_dtype(ready.payload_dtype)
            except ValueError:
                sink_dtype = None
            if sink_dtype is not None and math.prod(ready.payload_shape) > 0:
                sink = torch.empty(ready.payload_shape, dtype=sink_dtype, device=self.kv_cache.device)
                dist.recv(sink, src=peer["rank"])
            raise TransferError(f"request {ready.request_id}: payload {ready.payload_shape} "
                                f"{ready.payload_dtype}; expected {want} {self.kv_cache.dtype}")
        buf = torch.empty(want, dtype=self.kv_cache.dtype, device=self.kv_cache.device)
        dist.recv(buf, src=peer["rank"])
        scatter_kv(self.kv_cache, dst_blocks, buf)


class DistSender(KVSender):
    def __init__(self, kv_cache: torch.Tensor, peer_info: dict, backend: str) -> None:
        super().__init__(kv_cache, peer_info)
        self.backend = backend
        self._pending: list[tuple[object, torch.Tensor]] = []  # (work, buffer kept alive)

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        buf = gather_kv(self.kv_cache, src)
        ready.payload_shape = list(buf.shape)
        ready.payload_dtype = dtype_name(buf.dtype)
        work = dist.isend(buf, dst=self.peer_info["rank"])
        self._pending.append((work, buf))
        self.bytes_sent += buf.numel() * buf.element_size()
        return []

    def poll(self) -> None:
        self._pending = [(w, b) for w, b in self._pending if not w.is_completed()]

    def close(self) -> None:
        for work, _ in self._pending:
            work.wait()
        self._pending = []
