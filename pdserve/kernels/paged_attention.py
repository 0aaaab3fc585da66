"""Triton kernel: single-token (decode) attention over a paged KV cache, split along the
context (flash-decoding) so that a small batch still keeps every SM streaming.

Decode attention is a read of each sequence's whole K/V per step: bound by memory, and
only fast if enough loads are in flight. One program per (sequence, kv head, split of the
context): its rows are the GQA group's query heads (padded to 16 rows for tl.dot), each
iteration gathers BLOCK_N keys -- several cache blocks -- through the block table, and an
online softmax in float32 (exp2, log2(e) folded into the scale) keeps an unnormalised
partial. With one split the program writes the output itself; with several, a second
kernel merges the splits' partials by their maxima and sums. A sequence with an empty
context gets zeros. The split count is fixed by the host from the batch, the table width
and the SM count -- never from the context lengths, which live on the device -- so a CUDA
graph captures it.

This module imports triton at import time; ``kernels`` only imports it lazily.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from .attention_step import keys_step

# keys per step, warps: the largest that compile for sm_90 without spilling registers at
# head_dim 128 (64 keys on 4 warps spill); 16-bit inputs on tensor cores, float32 on FMA units
BLOCK_N = 32
WARPS = {torch.float32: 8}  # else 4
MAX_SPLITS = 32


@triton.jit
def _decode_split_kernel(
    out_ptr,  # [B, Hq, D] (one split)
    part_ptr,  # [B, Hq, splits, BLOCK_D + 2] float32: acc, then m and l (several splits)
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale_log2,
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
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    ROWS: tl.constexpr,  # GROUP padded to a power of two >= 16
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ONE_PASS: tl.constexpr,  # one split (the grid's third size is 1): write the output here
    IEEE: tl.constexpr,  # float32 inputs: products at IEEE float32, not TF32
):
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    splits = tl.num_programs(2)  # a runtime value: one compiled kernel for every split count (CUDA graphs' buckets)

    ctx_len = tl.load(context_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(ctx_len, splits), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(ctx_len, lo + per_split)

    g = tl.arange(0, ROWS)
    g_ok = g < GROUP
    head = kvh * GROUP + g
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)  # [ROWS, BLOCK_D]

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    table = block_tables_ptr + b * stride_btb
    for start in range(lo, hi, BLOCK_N):  # >= 1 key per step
        m_i, l_i, acc = keys_step(q, m_i, l_i, acc, start, hi, hi, table, stride_btm, k_cache_ptr, v_cache_ptr, kvh,
                                  stride_kb, stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd,
                                  scale_log2, offs_n, offs_d, d_ok, BLOCK_SIZE, True, False, IEEE)

    if ONE_PASS:
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # an empty context: zeros
        tl.store(out_ptr + b * stride_ob + head[:, None] * stride_oh + offs_d[None, :] * stride_od,
                 out.to(out_ptr.dtype.element_ty), mask=g_ok[:, None] & d_ok[None, :])
    else:
        row = part_ptr + ((b * GROUP * tl.num_programs(1) + head) * splits + split) * (BLOCK_D + 2)  # [ROWS]
        tl.store(row[:, None] + offs_d[None, :], acc, mask=g_ok[:, None])
        tl.store(row + BLOCK_D, m_i, mask=g_ok)
        tl.store(row + BLOCK_D + 1, l_i, mask=g_ok)


@triton.jit
def _decode_merge_kernel(
    out_ptr,
    part_ptr,  # [B, Hq, splits, BLOCK_D + 2] float32
    stride_ob,
    stride_oh,
    stride_od,
    splits,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,  # MAX_SPLITS: one compiled kernel for every split count
):
    """One (sequence, query head): the splits' partials merged by their maxima."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < splits
    offs_d = tl.arange(0, BLOCK_D)
    rows = part_ptr + ((b * tl.num_programs(1) + h) * splits + s) * (BLOCK_D + 2)  # [BLOCK_S]
    m = tl.load(rows + BLOCK_D, mask=s_ok, other=float("-inf"))
    l_s = tl.load(rows + BLOCK_D + 1, mask=s_ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # every split empty: weights 0, output 0
    w = tl.exp2(m - m_max)  # an empty split (m = -inf): 0
    total = tl.sum(w * l_s, axis=0)
    acc = tl.load(rows[:, None] + offs_d[None, :], mask=s_ok[:, None], other=0.0)  # [BLOCK_S, BLOCK_D]
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d * stride_od, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # Triton's interpreter on the CPU: a few splits, so that the tests run the merge
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, max_tokens: int, sms: int) -> int:
    """Context splits per (sequence, kv head): enough programs for ~4 per SM, each split at
    least two iterations of the longest context the tables can hold (`max_tokens`)."""
    want = -(-4 * sms // max(1, batch * kv_heads))
    most = max(1, -(-max_tokens // (2 * BLOCK_N)))
    return max(1, min(want, most, MAX_SPLITS))


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
    splits: int | None = None,  # context splits (None: `num_splits` for this device)
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
    if splits is None:
        splits = num_splits(b, hkv, block_tables.shape[1] * block_size, _sm_count(q.device))
    rows = max(16, triton.next_power_of_2(group))
    block_d = max(16, triton.next_power_of_2(d))
    part = torch.empty((b, hq, splits, block_d + 2), dtype=torch.float32, device=q.device) if splits > 1 else out
    _decode_split_kernel[(b, hkv, splits)](
        out, part, q, k_cache, v_cache, block_tables, context_lens.contiguous(),
        float(scale) * math.log2(math.e),
        q.stride(0), q.stride(1), q.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        *k_cache.stride(), *v_cache.stride(),
        block_tables.stride(0), block_tables.stride(1),
        GROUP=group, D=d, BLOCK_SIZE=block_size, ROWS=rows, BLOCK_N=BLOCK_N, BLOCK_D=block_d, ONE_PASS=splits == 1,
        IEEE=q.dtype == torch.float32,
        num_warps=WARPS.get(q.dtype, 4), num_stages=2,
    )
    if splits > 1:
        _decode_merge_kernel[(b, hq)](
            out, part, out.stride(0), out.stride(1), out.stride(2), splits,
            D=d, BLOCK_D=block_d, BLOCK_S=MAX_SPLITS, num_warps=4,
        )
    return out
