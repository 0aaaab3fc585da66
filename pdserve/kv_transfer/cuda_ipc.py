"""Same-host GPU transfer: the decode worker exports its CUDA KV cache through CUDA IPC;
the prefill worker opens the handle and copies blocks device to device, layer by layer.

Ran on an H100 (docs/gpu.md: two processes, a P/D pair token-exact against transformers).
CI has no GPU: there the view reconstruction is unit-tested on CPU storages.
"""
from __future__ import annotations

import torch

from pdserve.common.config import parse_dtype
from pdserve.common.wire.messages import KVReady
from pdserve.kv_transfer.base import KVReceiver, KVSender, copy_blocks, dtype_name


def export_handle(t: torch.Tensor) -> dict:
    """A msgpack-able description of a CUDA tensor's storage for another process."""
    storage = t.untyped_storage()
    (device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = storage._share_cuda_()
    return {"device": device, "handle": handle, "size": size, "offset": offset,
            "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
            "event_sync": event_sync, "shape": list(t.shape), "stride": list(t.stride()),
            "storage_offset": t.storage_offset(), "dtype": dtype_name(t.dtype)}


def _ints(v: object, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise ValueError(f"CUDA IPC view: {what} must be a list of non-negative integers, got {v!r}")
    return v


def view_from_storage(storage: torch.UntypedStorage, info: dict) -> torch.Tensor:
    """Rebuild the exported tensor's view (dtype, shape, strides) over an opened storage.
    The peer supplies shape, stride and offset: ValueError unless every element they
    address lies inside the storage (set_ itself would let a view reach past it)."""
    dtype = parse_dtype(info["dtype"])
    shape, stride = _ints(info.get("shape"), "shape"), _ints(info.get("stride"), "stride")
    offset = info.get("storage_offset")
    if len(shape) != len(stride) or len(shape) > 16:
        raise ValueError(f"CUDA IPC view: shape {shape} and stride {stride} do not match")
    if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"CUDA IPC view: storage_offset must be a non-negative integer, got {offset!r}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if 0 not in shape:
        last = offset + sum((n - 1) * st for n, st in zip(shape, stride))  # the farthest element addressed
        if (last + 1) * itemsize > storage.nbytes():
            raise ValueError(f"CUDA IPC view: shape {shape}, stride {stride}, offset {offset} reach element {last}, "
                             f"past the shared storage of {storage.nbytes() // itemsize} {info['dtype']} elements")
    t = torch.empty(0, dtype=dtype, device=storage.device)
    t.set_(storage, offset, shape, stride)
    return t


def open_handle(info: dict) -> torch.Tensor:
    storage = torch.UntypedStorage._new_shared_cuda(
        info["device"], info["handle"], info["size"], info["offset"], info["ref_handle"],
        info["ref_offset"], info["event_handle"], info["event_sync"])
    return view_from_storage(storage, info)


class CudaIpcReceiver(KVReceiver):
    backend = "cuda_ipc"

    def backend_info(self) -> dict:
        return {"ipc": export_handle(self.kv_cache)}


class CudaIpcSender(KVSender):
    backend = "cuda_ipc"
    layerwise = True

    def __init__(self, kv_cache: torch.Tensor, peer_info: dict) -> None:
        super().__init__(kv_cache, peer_info)
        self.remote = open_handle(peer_info["ipc"])
        self._layer_block_bytes = self.remote[:, 0, 0].numel() * self.remote.element_size()

    def write_layer(self, layer: int, src: list[int], dst: list[int]) -> None:
        copy_blocks(self.remote, self.kv_cache, src, dst, layer)
        self.bytes_sent += len(src) * self._layer_block_bytes

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        torch.cuda.current_stream(self.kv_cache.device).synchronize()  # D reads after KVReady
        return []
