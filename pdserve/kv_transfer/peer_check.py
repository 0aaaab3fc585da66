"""What a prefill worker checks in a decode worker's handshake before it writes a byte
into that worker's memory: the cache it names must be the one the deployment gives that
decode worker (shm: P computes the segment's name itself), of the layout both agreed on,
and every block id a later PrefillRequest names must lie inside it."""
from __future__ import annotations

import re
from typing import Any

from pdserve.common.wire.messages import KVLayout
from pdserve.kv_transfer.base import TransferError


def shm_name_hint(worker_id: str, deployment_id: str) -> str:
    """The middle of a decode worker's shm segment name: `pdserve-<hint>-<random>`. It
    derives from the deployment (a key only its processes hold) and the worker's id."""
    return f"{worker_id}-{deployment_id}"


def _int(info: dict[str, Any], key: str, lo: int, hi: int) -> int:
    v = info.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v < hi:
        raise TransferError(f"handshake field {key!r} must be an integer in [{lo}, {hi}), got {v!r}")
    return v


def check_peer_info(backend: str, info: dict[str, Any], layout: KVLayout, decode_id: str,
                    deployment_id: str, world_size: int = 0, own_rank: int = -1) -> int:
    """The number of KV blocks of the decode worker's cache, or TransferError naming what
    in its handshake does not belong to this deployment or layout."""
    num_blocks = _int(info, "num_blocks", 1, 1 << 31)
    if backend == "shm":
        name = info.get("shm_name")
        pattern = rf"pdserve-{re.escape(shm_name_hint(decode_id, deployment_id))}-[0-9a-f]{{10}}"
        if not isinstance(name, str) or not re.fullmatch(pattern, name):
            raise TransferError(f"shared-memory segment {name!r} is not decode worker {decode_id!r}'s cache "
                                f"in this deployment")
        expect = [2, layout.num_layers, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim]
        if info.get("shape") != expect:
            raise TransferError(f"cache shape {info.get('shape')!r} does not match the layout {expect}")
        if info.get("dtype") != layout.dtype:
            raise TransferError(f"cache dtype {info.get('dtype')!r} is not the layout's {layout.dtype!r}")
    if backend in ("gloo", "nccl"):
        rank = _int(info, "rank", 0, max(world_size, 1))
        if rank == own_rank:
            raise TransferError(f"decode worker claims this worker's own rank {rank}")
    return num_blocks


def check_block_ids(dst_block_ids: list[int], num_blocks: int) -> str | None:
    """Why `dst_block_ids` cannot be written into a cache of `num_blocks` blocks, or None."""
    bad = [b for b in dst_block_ids if not 0 <= b < num_blocks]
    if bad:
        return f"block id(s) {bad[:4]} outside the decode cache of {num_blocks} blocks"
    if len(set(dst_block_ids)) != len(dst_block_ids):
        return "duplicate destination block ids"
    return None
