"""Triton kernel: write new tokens' K/V into the paged KV cache.

(Module is deliberately not named ``store_kv`` so that importing it never
shadows the ``kernels.store_kv`` dispatcher function.)
This module imports triton at import time; ``kernels`` only imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kn,
    stride_kh,
    stride_kd,
    stride_vn,
    stride_vh,
    stride_vd,
    stride_cs,  # cache stride between slots (block_size*... flattened), both caches
    stride_ch,
    stride_cd,
    HKV: tl.constexpr,
    D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per token: copies its [Hkv, D] key and value rows.
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < HKV) & (offs_d[None, :] < D) & (slot >= 0)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        key_ptr + i * stride_kn + offs_h[:, None] * stride_kh + offs_d[None, :] * stride_kd,
        mask=mask,
        other=0.0,
    )
    v = tl.load(
        value_ptr + i * stride_vn + offs_h[:, None] * stride_vh + offs_d[None, :] * stride_vd,
        mask=mask,
        other=0.0,
    )
    safe_slot = tl.maximum(slot, 0)
    c_off = safe_slot * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :] * stride_cd
    tl.store(k_cache_ptr + c_off, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + c_off, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], contiguous
    slot_mapping: torch.Tensor,  # [N] int64 or int32, -1 = skip
) -> None:
    """Triton version of :func:`kernels.reference.store_kv` (in place, skips slot -1)."""
    n = slot_mapping.shape[0]
    if n == 0:
        return
    _, _, hkv, d = k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "KV caches must be contiguous"
    assert k_cache.shape == v_cache.shape
    assert key.shape == (n, hkv, d) and value.shape == (n, hkv, d), (key.shape, value.shape)
    slot_mapping = slot_mapping.contiguous()
    _store_kv_kernel[(n,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        key.stride(2),
        value.stride(0),
        value.stride(1),
        value.stride(2),
        hkv * d,
        d,
        1,
        HKV=hkv,
        D=d,
        BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d),
    )
