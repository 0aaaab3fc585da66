"""Triton kernel: causal attention of a step's prompt chunks over the paged KV cache,
all sequences in one launch (varlen), FlashAttention-style.

Every chunk's own K/V is stored in the cache before attention (as for decode), so a
query reads one thing: its sequence's cache, cached prefix and chunk alike, in place
through the block table -- no gather of the context, no dense mask. Query row i of a
chunk of `q_len` rows, in a sequence of `ctx_len` cached tokens (the chunk included),
sits at position ctx_len - q_len + i and sees positions <= it.

One program per (sequence, tile of TOK_M query tokens, kv head). Its rows are the tile's
tokens times the GQA group's query heads (token-major), so each K/V tile is loaded once
for the whole group and a one-token chunk still fills a tensor-core tile. Scores and the
online softmax are float32 (exp2 with log2(e) folded into the scale); P is cast to V's
dtype for the second product, as FlashAttention does. float32 inputs multiply at IEEE
float32 (no TF32), so that float32 greedy output stays exact. The keys every row of a tile
sees (below its first token) go through a step without masks; only the diagonal steps mask.

This module imports triton at import time; ``kernels`` imports it lazily.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .attention_step import keys_step


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    cu_seqlens_q_ptr,
    context_lens_ptr,
    scale_log2,  # softmax scale * log2(e)
    stride_qn,
    stride_qh,
    stride_qd,
    stride_on,
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
    num_tiles,  # query tiles per sequence in this launch (for the longest chunk)
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_G: tl.constexpr,  # GROUP rounded up to a power of two
    TOK_M: tl.constexpr,  # query tokens per tile
    BLOCK_N: tl.constexpr,  # keys per loop iteration
    BLOCK_D: tl.constexpr,
    IEEE: tl.constexpr,  # float32 inputs: products at IEEE float32, not TF32
):
    seq = tl.program_id(0).to(tl.int64)
    # the longest (last) tiles first: under causality they carry the most keys
    tile = num_tiles - 1 - tl.program_id(1)
    kvh = tl.program_id(2).to(tl.int64)

    q_begin = tl.load(cu_seqlens_q_ptr + seq)
    q_len = tl.load(cu_seqlens_q_ptr + seq + 1) - q_begin
    if tile * TOK_M >= q_len:
        return
    ctx_len = tl.load(context_lens_ptr + seq)

    offs_m = tl.arange(0, TOK_M * BLOCK_G)  # tile rows: token-major, the group's heads within
    tok = tile * TOK_M + offs_m // BLOCK_G  # [M] chunk-relative token
    g = offs_m % BLOCK_G
    head = kvh * GROUP + g
    row_ok = (tok < q_len) & (g < GROUP)
    q_pos = ctx_len - q_len + tok  # [M] absolute position of each row's token
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)

    rows = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qn + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BLOCK_D]

    m_i = tl.full([TOK_M * BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([TOK_M * BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([TOK_M * BLOCK_G, BLOCK_D], dtype=tl.float32)

    # keys [0, full_end) are seen by every row of the tile (whole BLOCK_N steps below its
    # first token's position): no mask there; the rest, up to the tile's last token, masked
    table = block_tables_ptr + seq * stride_btb
    kv_end = tl.minimum(ctx_len, ctx_len - q_len + (tile + 1) * TOK_M)
    full_end = (ctx_len - q_len + tile * TOK_M + 1) // BLOCK_N * BLOCK_N
    for start in range(0, full_end, BLOCK_N):
        m_i, l_i, acc = keys_step(q, m_i, l_i, acc, start, kv_end, q_pos, table, stride_btm, k_cache_ptr, v_cache_ptr,
                                  kvh, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                                  stride_vd, scale_log2, offs_n, offs_d, d_ok, BLOCK_SIZE, False, False, IEEE)
    for start in range(full_end, kv_end, BLOCK_N):  # every row has key 0: no row is ever all masked
        m_i, l_i, acc = keys_step(q, m_i, l_i, acc, start, kv_end, q_pos, table, stride_btm, k_cache_ptr, v_cache_ptr,
                                  kvh, stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh,
                                  stride_vd, scale_log2, offs_n, offs_d, d_ok, BLOCK_SIZE, True, True, IEEE)

    out = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def _tiles(dtype: torch.dtype, block_g: int, block_d: int) -> tuple[int, int, int, int]:
    """(query tokens per tile, keys per step, warps, pipeline stages). 16-bit inputs: tiles
    of 128 rows by 32 keys on 8 warps (tensor cores); float32 (IEEE products, on FMA units:
    the exactness checks, not speed): 32 by 16. The largest shapes that compile for sm_90
    without spilling registers at head_dim 128 (the gathered K/V pointers cost registers
    that a contiguous FlashAttention kernel does not spend: 128 x 64 spills)."""
    rows, block_n = (128, 32) if dtype in (torch.bfloat16, torch.float16) else (32, 16)
    if block_d > 128:
        rows //= 2
    tok_m = max(1, rows // block_g)
    while tok_m * block_g < 16:  # tl.dot needs 16 rows
        tok_m *= 2
    return tok_m, block_n, 8, 2


def paged_prefill_attention(
    q: torch.Tensor,  # [N, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [P, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor,  # [P + 1] int32: sequence p's rows are q[cu[p]:cu[p + 1]]
    context_lens: torch.Tensor,  # [P] int32: cached tokens, each chunk's own included
    max_q_len: int,  # the longest chunk (a host int: it sizes the grid)
    scale: float,
    out: torch.Tensor | None = None,  # [N, Hq, D] to write into; rows outside the chunks are left as they were
) -> torch.Tensor:  # [N, Hq, D], q.dtype
    """Triton version of :func:`kernels.reference.paged_prefill_attention`."""
    n, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    assert dk == d and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape, v_cache.shape)
    assert hq % hkv == 0, f"Hq={hq} not a multiple of Hkv={hkv}"
    p = context_lens.shape[0]
    assert cu_seqlens_q.shape[0] == p + 1 and block_tables.shape[0] == p
    if out is None:
        out = torch.zeros_like(q)
    if p == 0 or max_q_len == 0:
        return out
    group = hq // hkv
    block_g = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(d))
    tok_m, block_n, warps, stages = _tiles(q.dtype, block_g, block_d)
    num_tiles = triton.cdiv(max_q_len, tok_m)
    _paged_prefill_kernel[(p, num_tiles, hkv)](
        out, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
        float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), block_tables.stride(1),
        num_tiles,
        GROUP=group, D=d, BLOCK_SIZE=block_size, BLOCK_G=block_g, TOK_M=tok_m, BLOCK_N=block_n, BLOCK_D=block_d,
        IEEE=q.dtype == torch.float32,
        num_warps=warps, num_stages=stages,
    )
    return out
