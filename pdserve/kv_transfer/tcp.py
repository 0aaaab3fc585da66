"""Transfer without shared memory or a collective library: the blocks are gathered into
one contiguous buffer and travel as a raw ZeroMQ frame behind the KVReady message."""
from __future__ import annotations

import math
import warnings

import torch

from pdserve.common.wire.messages import KVReady
from pdserve.kv_transfer.base import KVReceiver, KVSender, TransferError, dtype_name, gather_kv, scatter_kv


class TcpReceiver(KVReceiver):
    backend = "tcp"

    def backend_info(self) -> dict:
        return {}

    def receive(self, ready: KVReady, frames: list[bytes], dst_blocks: list[int], peer: dict) -> None:
        super().receive(ready, frames, dst_blocks, peer)
        want = self.expected_shape(len(dst_blocks))
        if ready.payload_shape != want or len(frames) != 1:
            raise TransferError(f"request {ready.request_id}: payload shape {ready.payload_shape} in "
                                f"{len(frames)} frame(s); expected {want} in 1")
        dtype = self.kv_cache.dtype
        nbytes = math.prod(want) * self.kv_cache.element_size()
        if len(frames[0]) != nbytes or ready.payload_dtype != dtype_name(dtype):
            raise TransferError(f"request {ready.request_id}: {len(frames[0])} bytes of {ready.payload_dtype}; "
                                f"expected {nbytes} bytes of {dtype}")
        with warnings.catch_warnings():  # a read-only frame is fine: it is only read
            warnings.simplefilter("ignore", UserWarning)
            buf = torch.frombuffer(frames[0], dtype=dtype).view(want)
        scatter_kv(self.kv_cache, dst_blocks, buf)


class TcpSender(KVSender):
    backend = "tcp"

    def send(self, ready: KVReady, src: list[int], dst: list[int]) -> list:
        buf = gather_kv(self.kv_cache, src).cpu()
        ready.payload_shape = list(buf.shape)
        ready.payload_dtype = dtype_name(buf.dtype)
        ready.num_frames = 1
        self.bytes_sent += buf.numel() * buf.element_size()
        return [buf.reshape(-1).view(torch.uint8).numpy().data]  # zero-copy raw bytes
