"""Same-host CPU transfer: the decode worker's KV cache lives in POSIX shared memory;
the prefill worker maps it and copies finished blocks straight into the reserved slots,
layer by layer as its forward pass finishes each layer."""
from __future__ import annotations

import math
import uuid
from multiprocessing import resource_tracker, shared_memory

import torch

from pdserve.common.config import parse_dtype
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.common.wire.messages import KVReady
from pdserve.kv_transfer.base import KVReceiver, KVSender, copy_blocks, dtype_name


def _view(shm: shared_memory.SharedMemory, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV cache laid in the segment, in the CPU cache's memory order."""
    return kv_cache_tensor(shape, dtype, "cpu", storage=torch.frombuffer(shm.buf, dtype=dtype, count=math.prod(shape)))


class ShmReceiver(KVReceiver):
    """Owns the shared-memory segment backing the decode worker's KV cache."""

    backend = "shm"

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, name_hint: str) -> None:
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.name = f"pdserve-{name_hint}-{uuid.uuid4().hex[:10]}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=nbytes)
        super().__init__(_view(self._shm, shape, dtype))
        self.kv_cache.zero_()
        self._dtype = dtype

    def backend_info(self) -> dict:
        return {"shm_name": self.name, "shape": list(self.kv_cache.shape), "dtype": dtype_name(self._dtype)}

    def close(self) -> None:
        if self._shm is None:
            return  # already closed
        self.kv_cache = None  # type: ignore[assignment]
        try:
            self._shm.unlink()  # first: the name must go even if a view still pins the mapping
        except FileNotFoundError:
            pass
        try:
            self._shm.close()
        except BufferError:
            pass  # a tensor view is still alive; the mapping goes with the process
        self._shm = None


class ShmSender(KVSender):
    """Maps a decode worker's shared cache; writes are plain memory copies."""

    backend = "shm"
    layerwise = True

    def __init__(self, kv_cache: torch.Tensor, peer_info: dict) -> None:
        super().__init__(kv_cache, peer_info)
        self._shm = shared_memory.SharedMemory(name=peer_info["shm_name"], create=False)
        # Python < 3.13 registers attached segments too and would unlink D's cache when
        # this process exits; the owner (D) unlinks it.
        try:
            resource_tracker.unregister(self._shm._name, "shared_memory")  # type: ignore[attr-defined]
        except Exception:
            pass
        self.remote = _view(self._shm, tuple(peer_info["shape"]), parse_dtype(peer_info["dtype"]))
        self._block_bytes = self.remote[:, :, 0].numel() * self.remote.element_size()

    def write_layer(self, layer: int, src: list[int], dst: list[int]) -> None:
        copy_blocks(self.remote, self.kv_cache, src, dst, layer)
        self.bytes_sent += len(src) * self._block_bytes // self.remote.shape[1]

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        return []  # everything was written layer by layer

    def close(self) -> None:
        del self.remote
        try:
            self._shm.close()
        except BufferError:
            pass
