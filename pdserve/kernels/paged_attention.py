"""Triton kernel: single-token (decode) attention over a paged KV cache.

One program per (sequence, kv head); it handles all ``group`` query heads that
share that kv head, so each K/V block is loaded once per GQA group. Scores use
elementwise multiply + ``tl.sum`` (no ``tl.dot``; fine for one query token) and an
online softmax in fp32 over one cache block per loop iteration.

This module imports triton at import time; ``kernels`` only imports it lazily.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_ob,
    stride_oh,
    stride_od,
    stride_kb,  # k/v cache strides: block, token, head, dim
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_btb,
    stride_btm,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)

    offs_g = tl.arange(0, BLOCK_G)  # query heads in this group
    offs_n = tl.arange(0, BLOCK_N)  # tokens in a cache block
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < D
    n_mask = offs_n < BLOCK_SIZE

    heads = kvh * GROUP + offs_g  # [BLOCK_G]
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :] * stride_qd,
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(tl.float32)  # [BLOCK_G, BLOCK_D]

    ctx_len = tl.load(context_lens_ptr + b)
    num_blocks = tl.cdiv(ctx_len, BLOCK_SIZE)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)

    kv_mask = n_mask[:, None] & d_mask[None, :]  # [BLOCK_N, BLOCK_D]
    for j in range(0, num_blocks):
        block_id = tl.load(block_tables_ptr + b * stride_btb + j * stride_btm).to(tl.int64)
        block_id = tl.maximum(block_id, 0)
        k = tl.load(
            k_cache_ptr
            + block_id * stride_kb
            + offs_n[:, None] * stride_kt
            + kvh * stride_kh
            + offs_d[None, :] * stride_kd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]
        v = tl.load(
            v_cache_ptr
            + block_id * stride_vb
            + offs_n[:, None] * stride_vt
            + kvh * stride_vh
            + offs_d[None, :] * stride_vd,
            mask=kv_mask,
            other=0.0,
        ).to(tl.float32)  # [BLOCK_N, BLOCK_D]

        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [BLOCK_G, BLOCK_N]
        pos = j * BLOCK_SIZE + offs_n
        valid = n_mask & (pos < ctx_len)  # [BLOCK_N]; >= 1 valid token per iteration
        s = tl.where(valid[None, :], s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # empty context -> output 0
    out = acc / l_safe[:, None]
    tl.store(
        out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :] * stride_od,
        out.to(out_ptr.dtype.element_ty),
        mask=g_mask[:, None] & d_mask[None, :],
    )


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D], q.dtype
    """Triton version of :func:`kernels.reference.paged_decode_attention`."""
    b, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert hq % hkv == 0, f"Hq={hq} not a multiple of Hkv={hkv}"
    assert block_tables.shape[0] == b and context_lens.shape[0] == b
    group = hq // hkv
    out = torch.empty((b, hq, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_g = triton.next_power_of_2(group)
    block_n = triton.next_power_of_2(block_size)
    block_d = triton.next_power_of_2(d)
    tile = block_g * block_n * block_d
    num_warps = 4 if tile <= 8192 else 8
    context_lens = context_lens.contiguous()
    _paged_decode_kernel[(b, hkv)](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        context_lens,
        float(scale),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        out.stride(0),
        out.stride(1),
        out.stride(2),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.stride(3),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        v_cache.stride(3),
        block_tables.stride(0),
        block_tables.stride(1),
        GROUP=group,
        D=d,
        BLOCK_SIZE=block_size,
        BLOCK_G=block_g,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        num_warps=num_warps,
    )
    return out
