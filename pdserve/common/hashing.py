"""Chained block hashes, identical in every process (router, P, D, offline engine).

The hash of block i covers every token of blocks 0..i: it is computed from the hash of
block i-1 and block i's own token ids. Only full blocks have a hash.
"""
from __future__ import annotations

import hashlib

import numpy as np

ROOT_HASH = 0


def hash_block(parent_hash: int, token_ids: list[int] | np.ndarray) -> int:
    """64-bit unsigned hash of one full block chained onto its parent's hash."""
    h = hashlib.blake2b(digest_size=8)
    h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype="<i4").tobytes())
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: list[int], block_size: int, max_blocks: int | None = None) -> list[int]:
    """Hashes of the leading full blocks of `token_ids` (at most `max_blocks` of them)."""
    n = len(token_ids) // block_size
    if max_blocks is not None:
        n = min(n, max_blocks)
    arr = np.asarray(token_ids[: n * block_size], dtype="<i4")
    hashes: list[int] = []
    parent = ROOT_HASH
    for i in range(n):
        parent = hash_block(parent, arr[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes


def cacheable_prefix_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """Hashes of the blocks a prefix-cache lookup may match.

    A prompt's final token is never matched, so at least one token is always computed
    (its logits give the first output token).
    """
    return block_hashes(token_ids, block_size, max_blocks=(len(token_ids) - 1) // block_size)
