"""Paged attention over one layer's KV cache, for a batch mixing decode and prefill.

The batch is laid out decode-first: the first `num_decode` sequences contribute one
query token each (tokens [0, num_decode)), the prefill sequences follow, sequence p's
rows being [cu_seqlens_q[p], cu_seqlens_q[p + 1]). Every token's K/V is stored into the
cache before attention, so a query attends to cached context and to its own chunk alike.

Prompt chunks: on CUDA every chunk of the step in one Triton varlen kernel that reads the
cache in place (`kernels.triton_paged_prefill_attention`); on the CPU the native kernel,
one call for all chunks; elsewhere (CPU dtypes the native kernel does not take, or
PDSERVE_DISABLE_TRITON on CUDA) SDPA one chunk at a time over its gathered context.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve import kernels


@dataclass(frozen=True)
class PrefillMetadata:
    """The step's prompt chunks, after its decode rows (built once per step by the model
    runner; the tensors on the model's device, the lists on the host)."""

    q_lens: list[int]  # per sequence: its chunk's tokens
    context_lens: list[int]  # per sequence: cached tokens, its chunk included
    block_tables: torch.Tensor  # [P, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor  # [P + 1] int32: sequence p's rows in the step; cu_seqlens_q[0] = num_decode
    context_lens_t: torch.Tensor  # [P] int32, `context_lens` on the device

    @property
    def max_q_len(self) -> int:
        return max(self.q_lens)


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = do not store
    num_decode: int  # sequences with exactly one query token, placed first
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32, -1 padded
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill: PrefillMetadata | None = None  # the prompt chunks; None in a pure decode step


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [N, Hq, D], k/v [N, Hkv, D]; caches [num_blocks, block_size, Hkv, D] -> [N, Hq, D]."""
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode
    if nd == q.shape[0]:  # a pure decode batch: the kernel's output is the whole answer
        return kernels.paged_decode_attention(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                                              scale)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = kernels.paged_decode_attention(
            q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    pre = meta.prefill
    assert pre is not None, "rows past the decode rows are prompt chunks"
    if kernels.use_triton(q):  # every chunk in one varlen kernel, cached prefixes read in place
        return kernels.triton_paged_prefill_attention(q, k_cache, v_cache, pre.block_tables, pre.cu_seqlens_q,
                                                      pre.context_lens_t, pre.max_q_len, scale, out=out)
    starts = [nd + sum(pre.q_lens[:i]) for i in range(len(pre.q_lens))]
    if q.device.type == "cpu":
        from pdserve.kernels import cpu_native
        if cpu_native.supports_prefill(q, k_cache, v_cache):  # every chunk in one native call
            return cpu_native.prefill_attention(q, k_cache, v_cache, pre.block_tables, starts, pre.q_lens,
                                                pre.context_lens, scale, out=out)
    return sdpa_prefill(q, k, v, k_cache, v_cache, pre, starts, scale, out)


def sdpa_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 pre: PrefillMetadata, starts: list[int], scale: float, out: torch.Tensor) -> torch.Tensor:
    """The prompt chunks one at a time through SDPA: a chunk with nothing cached before it
    on its own fresh K/V (causal), a later chunk over its whole context gathered from the
    cache with a dense mask. Writes the chunks' rows of `out` and returns it."""
    block_size = k_cache.shape[1]
    group = q.shape[1] // k.shape[1]
    for i, (start, q_len, ctx_len) in enumerate(zip(starts, pre.q_lens, pre.context_lens)):
        end = start + q_len
        qs = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
        if ctx_len == q_len:  # nothing cached before this chunk: use the fresh K/V
            ks, vs = k[start:end], v[start:end]  # [q_len, Hkv, D]
            mask = None
        else:
            table = pre.block_tables[i, :-(-ctx_len // block_size)]
            # [ctx_len, Hkv, D] in q's dtype (a bf16 cache under float32 activations is widened)
            ks = k_cache.index_select(0, table).flatten(0, 1)[:ctx_len].to(q.dtype)
            vs = v_cache.index_select(0, table).flatten(0, 1)[:ctx_len].to(q.dtype)
            # query i sits at absolute position ctx_len - q_len + i and sees positions <= it
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(ctx_len, device=q.device)[None, :]
        ks = ks.transpose(0, 1)  # [Hkv, ctx_len, D]
        vs = vs.transpose(0, 1)
        # batched 4-D inputs: on CPU the 3-D form misses torch's flash kernel and takes the slow path
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=group > 1)  # [1, Hq, q_len, D]
        out[start:end] = o[0].transpose(0, 1)
    return out
