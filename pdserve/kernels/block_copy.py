"""Triton kernels: gather whole KV-cache blocks into a buffer and scatter them back.

This module imports triton at import time; ``kernels`` only imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_MAX_BLOCK = 4096


@triton.jit
def _gather_blocks_kernel(
    cache_ptr,
    ids_ptr,
    buf_ptr,
    E,  # elements per cache block
    BLOCK: tl.constexpr,
):
    # grid = (n, cdiv(E, BLOCK)): program (i, j) copies chunk j of block ids[i].
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    src = tl.load(ids_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(cache_ptr + src * E + offs, mask=mask)
    tl.store(buf_ptr + i * E + offs, x, mask=mask)


@triton.jit
def _scatter_blocks_kernel(
    cache_ptr,
    ids_ptr,
    buf_ptr,
    E,  # elements per cache block
    BLOCK: tl.constexpr,
):
    # grid = (n, cdiv(E, BLOCK)): program (i, j) writes chunk j of buf[i] to block ids[i].
    i = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1).to(tl.int64)
    dst = tl.load(ids_ptr + i).to(tl.int64)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < E
    x = tl.load(buf_ptr + i * E + offs, mask=mask)
    tl.store(cache_ptr + dst * E + offs, x.to(cache_ptr.dtype.element_ty), mask=mask)


def _block_numel(cache: torch.Tensor) -> int:
    e = 1
    for s in cache.shape[1:]:
        e *= s
    return e


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...]), contiguous
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D], contiguous
    """Triton version of :func:`kernels.reference.gather_blocks`."""
    assert cache.is_contiguous(), "cache must be contiguous"
    n = block_ids.shape[0]
    buf = torch.empty((n,) + tuple(cache.shape[1:]), dtype=cache.dtype, device=cache.device)
    e = _block_numel(cache)
    if n == 0 or e == 0:
        return buf
    ids = block_ids.to(device=cache.device).contiguous()
    block = min(_MAX_BLOCK, triton.next_power_of_2(e))
    _gather_blocks_kernel[(n, triton.cdiv(e, block))](cache, ids, buf, e, BLOCK=block)
    return buf


def scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...]), contiguous
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Triton version of :func:`kernels.reference.scatter_blocks` (in place)."""
    assert cache.is_contiguous(), "cache must be contiguous"
    n = block_ids.shape[0]
    e = _block_numel(cache)
    assert buf.shape == (n,) + tuple(cache.shape[1:]), (buf.shape, cache.shape)
    if n == 0 or e == 0:
        return
    ids = block_ids.to(device=cache.device).contiguous()
    buf = buf.to(device=cache.device).contiguous()
    block = min(_MAX_BLOCK, triton.next_power_of_2(e))
    _scatter_blocks_kernel[(n, triton.cdiv(e, block))](cache, ids, buf, e, BLOCK=block)
