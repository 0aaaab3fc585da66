"""The step both Triton attention kernels (`paged_attention`, `prefill_attention`) take:
BLOCK_N keys of one sequence, gathered through its block table, into a FlashAttention
online softmax. Scores and the running max / sum are float32 (exp2: log2(e) is folded into
the scale); P is cast to V's dtype for the second product. Imports triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def keys_step(q, m_i, l_i, acc, start, kv_end, q_pos, table, stride_btm, k_cache_ptr, v_cache_ptr, kvh, stride_kb,
              stride_kt, stride_kh, stride_kd, stride_vb, stride_vt, stride_vh, stride_vd, scale_log2, offs_n, offs_d,
              d_ok, BLOCK_SIZE: tl.constexpr, BOUNDED: tl.constexpr, CAUSAL: tl.constexpr, IEEE: tl.constexpr):
    """Keys [start, start + BLOCK_N) into (m_i [M], l_i [M], acc [M, BLOCK_D]) for the rows q
    [M, BLOCK_D]; returns the three. Keys at or past kv_end are never loaded; BOUNDED: the
    step may reach kv_end (else every key is below it: no mask); CAUSAL: row r sees keys
    <= q_pos[r]. IEEE: float32 inputs multiply at IEEE float32, not TF32."""
    k_pos = start + offs_n  # [BLOCK_N]
    k_ok = k_pos < kv_end
    block = tl.load(table + (k_pos // BLOCK_SIZE) * stride_btm, mask=k_ok, other=0)
    block = tl.maximum(block, 0).to(tl.int64)
    slot = k_pos % BLOCK_SIZE
    kv_mask = k_ok[:, None] & d_ok[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_kt + kvh * stride_kh
                + offs_d[None, :] * stride_kd, mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vt + kvh * stride_vh
                + offs_d[None, :] * stride_vd, mask=kv_mask, other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k).to(q.dtype), input_precision="ieee") * scale_log2
    else:
        s = tl.dot(q, tl.trans(k).to(q.dtype)) * scale_log2  # [M, BLOCK_N]
    if CAUSAL:
        s = tl.where(k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None]), s, float("-inf"))
    elif BOUNDED:
        s = tl.where(k_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc
