"""The transfer backend interface: a KVSender in the prefill worker writes or sends the
KV of finished prompt blocks; a KVReceiver in the decode worker owns the destination
cache and takes delivery. Both sides agree on a KVLayout (common.engine.kv_layout) at connect time."""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.common.checkpoint_dtype import dtype_name  # noqa: F401  (the transports' wire name of a dtype)
from pdserve.common.wire.messages import KVReady


class TransferError(RuntimeError):
    """A transfer does not fit the reservation it claims (wrong size, shape or peer)."""


def runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """Coalesce a block mapping into (src_start, dst_start, length) runs of consecutive ids,
    so large transfers become a few big copies instead of one copy per block."""
    out: list[tuple[int, int, int]] = []
    for s, d in sorted(zip(src, dst)):  # copy order is free; sorting also merges descending runs
        if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
        else:
            out.append((s, d, 1))
    return out


def gather_kv(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """kv_cache [2, L, num_blocks, bs, H, D] -> contiguous [2, L, n, bs, H, D]."""
    from pdserve import kernels
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    two, layers = kv_cache.shape[:2]
    buf = torch.empty((two, layers, len(block_ids), *kv_cache.shape[3:]), dtype=kv_cache.dtype,
                      device=kv_cache.device)
    for kv in range(two):
        for layer in range(layers):
            buf[kv, layer] = kernels.gather_blocks(kv_cache[kv, layer], ids)
    return buf


def scatter_kv(kv_cache: torch.Tensor, block_ids: list[int], buf: torch.Tensor) -> None:
    """Inverse of gather_kv: buf [2, L, n, bs, H, D] into kv_cache's blocks `block_ids`."""
    from pdserve import kernels
    ids = torch.tensor(block_ids, dtype=torch.int64, device=kv_cache.device)
    for kv in range(kv_cache.shape[0]):
        for layer in range(kv_cache.shape[1]):
            kernels.scatter_blocks(kv_cache[kv, layer], ids, buf[kv, layer])


# From this many runs on, a CUDA copy goes as one gather and one scatter per layer: each
# run's copy_ is a kernel launch, so scattered blocks copied run by run are launch-bound
# (docs/gpu.md). On CPU (shm) each run stays a memcpy, which has no launch to amortize.
INDEXED_COPY_MIN_RUNS = 4


def copy_blocks(dst_cache: torch.Tensor, src_cache: torch.Tensor, src: list[int], dst: list[int],
                layer: int | None = None) -> None:
    """Direct block copy between two mapped caches (shm, CUDA IPC), one layer or all."""
    layers = range(src_cache.shape[1]) if layer is None else (layer,)
    spans = runs(src, dst)
    if dst_cache.is_cuda and len(spans) >= INDEXED_COPY_MIN_RUNS:
        copy_blocks_indexed(dst_cache, src_cache, src, dst, layers)
        return
    for s, d, n in spans:
        for li in layers:
            dst_cache[:, li, d:d + n].copy_(src_cache[:, li, s:s + n])


def copy_blocks_indexed(dst_cache: torch.Tensor, src_cache: torch.Tensor, src: list[int], dst: list[int],
                        layers: range | tuple[int, ...]) -> None:
    """copy_blocks as one index_select and one index_copy_ per layer (K and V together);
    `dst` holds distinct ids (the receiver checked them)."""
    s_idx = torch.tensor(src, dtype=torch.int64, device=src_cache.device)
    d_idx = torch.tensor(dst, dtype=torch.int64, device=dst_cache.device)
    for li in layers:
        dst_cache[:, li].index_copy_(1, d_idx, src_cache[:, li].index_select(1, s_idx).to(dst_cache.device))


@dataclass
class PendingReceive:
    """A receive still in flight (a gloo/nccl `irecv`): the decode worker polls `done()`
    between steps and calls `land()` once, which raises TransferError if it failed."""

    done: Callable[[], bool]
    land: Callable[[], None]  # scatter the received buffer into the blocks


class KVReceiver(abc.ABC):
    """Decode side: owns the KV cache tensor that transfers land in."""

    backend: str

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache  # [2, L, num_blocks, bs, H, D]

    @abc.abstractmethod
    def backend_info(self) -> dict:
        """What a prefill worker needs to reach this cache (sent in the handshake)."""

    def expected_shape(self, num_blocks: int) -> list[int]:
        s = self.kv_cache.shape
        return [s[0], s[1], num_blocks, *s[3:]]

    def receive(self, ready: KVReady, frames: list[bytes], dst_blocks: list[int],
                peer: dict) -> PendingReceive | None:
        """Land the KV of `ready` in `dst_blocks` (None), or start to and return the
        pending receive; TransferError if it does not fit."""
        if ready.num_blocks != len(dst_blocks):
            raise TransferError(f"request {ready.request_id}: transfer of {ready.num_blocks} blocks, "
                                f"{len(dst_blocks)} were reserved")

    def close(self) -> None:
        pass


class KVSender(abc.ABC):
    """Prefill side, one per decode peer: moves blocks of P's cache into D's blocks."""

    backend: str
    layerwise = False  # True: write_layer is called after each layer's forward

    def __init__(self, kv_cache: torch.Tensor, peer_info: dict) -> None:
        self.kv_cache = kv_cache
        self.peer_info = peer_info
        self.bytes_sent = 0

    def write_layer(self, layer: int, src: list[int], dst: list[int]) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list[bytes | memoryview]:
        """Deliver all layers of `src` (if not already written layer by layer); fill in
        `ready`'s payload fields; return raw frames to append to the KVReady message."""

    def poll(self) -> None:
        """Complete background sends (gloo/nccl)."""

    def close(self) -> None:
        pass
