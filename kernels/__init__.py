"""KV-cache kernels for pdserve: Triton (GPU) versions and pure-torch references.

Public API (dispatchers; Triton on CUDA tensors when triton is usable, else torch)::

    store_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out
    gather_blocks(cache, block_ids) -> buf
    scatter_blocks(cache, block_ids, buf) -> None
    paged_prefill_attention(...)   # torch reference only

Explicit flavors: ``kernels.reference.<fn>`` and ``kernels.triton_<fn>``. The
Triton flavors also run on CPU tensors when ``TRITON_INTERPRET=1`` is set before
their first call (used by the tests).

Importing this package has no side effects and does not import triton; the Triton
modules (``kv_store``, ``paged_attention``, ``block_copy``) are imported on first use.
Set ``PDSERVE_DISABLE_TRITON=1`` to force the torch references everywhere.

NOTE: transformers probes for a package named ``kernels`` (the HF hub library) and
may import this one. Do not define ``__version__`` here or add names of that
library's API, or transformers may mistake this package for it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import reference

__all__ = [
    "reference",
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "gather_blocks",
    "scatter_blocks",
    "triton_store_kv",
    "triton_paged_decode_attention",
    "triton_gather_blocks",
    "triton_scatter_blocks",
    "triton_available",
    "use_triton",
]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True if the ``triton`` package can be found (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the dispatchers send a call with tensor ``t`` to the Triton flavor."""
    return (
        t.is_cuda
        and triton_available()
        and os.environ.get("PDSERVE_DISABLE_TRITON", "0") in ("", "0")
    )


# --------------------------------------------------------------------------- #
# Triton flavors (lazy import of the triton modules)
# --------------------------------------------------------------------------- #


def triton_store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64/int32, -1 = skip
) -> None:
    """Triton :func:`store_kv` (see :mod:`kernels.kv_store`)."""
    from .kv_store import store_kv as impl

    impl(key, value, k_cache, v_cache, slot_mapping)


def triton_paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Triton :func:`paged_decode_attention` (see :mod:`kernels.paged_attention`)."""
    from .paged_attention import paged_decode_attention as impl

    return impl(q, k_cache, v_cache, block_tables, context_lens, scale)


def triton_gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D]
    """Triton :func:`gather_blocks` (see :mod:`kernels.block_copy`)."""
    from .block_copy import gather_blocks as impl

    return impl(cache, block_ids)


def triton_scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Triton :func:`scatter_blocks` (see :mod:`kernels.block_copy`)."""
    from .block_copy import scatter_blocks as impl

    impl(cache, block_ids, buf)


# --------------------------------------------------------------------------- #
# Dispatchers
# --------------------------------------------------------------------------- #


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64/int32, -1 = skip
) -> None:
    """Write key/value rows into the paged caches at ``slot_mapping`` (in place)."""
    if use_triton(k_cache):
        triton_store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D], q.dtype
    """Decode attention (one query token per sequence) over paged KV."""
    if use_triton(q):
        return triton_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if q.device.type == "cpu":
        from . import cpu_attention, cpu_native
        if cpu_native.supports(q, k_cache, v_cache):
            return cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def paged_prefill_attention(
    q: torch.Tensor,  # [Ntok, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [Ntok, Hq, D]
    """Causal (chunked) prefill attention over paged KV (torch reference on all devices)."""
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
    )


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D], contiguous
    """Copy the given cache blocks into a new contiguous buffer."""
    if use_triton(cache) and cache.is_contiguous():
        return triton_gather_blocks(cache, block_ids)
    return reference.gather_blocks(cache, block_ids)


def scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Write ``buf[i]`` into ``cache[block_ids[i]]`` (in place)."""
    if use_triton(cache) and cache.is_contiguous():
        triton_scatter_blocks(cache, block_ids, buf)
    else:
        reference.scatter_blocks(cache, block_ids, buf)
