"""Transfer integrity: a checksum of the KV blocks a prefill worker sent, computed the
same way over the decode worker's copy, so a short or corrupt transfer is caught before
anything decodes from it (WorkerConfig.verify_transfers)."""
from __future__ import annotations

import zlib

import torch

from pdserve.kv_transfer.base import gather_kv


def kv_checksum(kv_cache: torch.Tensor, block_ids: list[int]) -> int:
    """crc32 of the blocks' K and V, every layer, in `block_ids` order (>= 0)."""
    buf = gather_kv(kv_cache, block_ids).contiguous().cpu()  # [2, layers, n, block, kv_heads, head_dim]
    return zlib.crc32(buf.view(torch.uint8).numpy().tobytes()) if buf.numel() else 0
