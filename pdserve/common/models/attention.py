"""Paged attention over one layer's KV cache, for a batch mixing decode and prefill.

The batch is laid out decode-first: the first `num_decode` sequences contribute one
query token each (tokens [0, num_decode)), the prefill sequences follow with
`cu_seqlens_q` offsets. Every token's K/V is stored into the cache before attention,
so a query attends to cached context and to its own chunk alike.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pdserve import kernels


@dataclass
class AttentionMetadata:
    """Per-step tensors shared by every layer (built once by the model runner)."""

    slot_mapping: torch.Tensor  # [N] int64, -1 = do not store
    num_decode: int  # sequences with exactly one query token, placed first
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int32, -1 padded
    decode_context_lens: torch.Tensor  # [num_decode] int32
    prefill_q_lens: list[int]  # per prefill sequence
    prefill_context_lens: list[int]  # per prefill sequence, includes its q tokens
    prefill_block_tables: list[torch.Tensor]  # per prefill sequence, [n_blocks] int64
    _prefill_tables: torch.Tensor | None = field(default=None, repr=False)

    def prefill_tables(self) -> torch.Tensor:
        """The prefill sequences' block tables as one [P, max_blocks] int32 tensor, -1
        padded (made once per step, on first use)."""
        if self._prefill_tables is None:
            width = max((len(t) for t in self.prefill_block_tables), default=0)
            tables = torch.full((len(self.prefill_block_tables), width), -1, dtype=torch.int32)
            for i, t in enumerate(self.prefill_block_tables):
                tables[i, :len(t)] = t
            self._prefill_tables = tables
        return self._prefill_tables


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
    if meta.prefill_q_lens and q.device.type == "cpu":
        from pdserve.kernels import cpu_native
        if cpu_native.supports_prefill(q, k_cache, v_cache):  # every chunk in one native call
            starts = [nd + sum(meta.prefill_q_lens[:i]) for i in range(len(meta.prefill_q_lens))]
            return cpu_native.prefill_attention(q, k_cache, v_cache, meta.prefill_tables(), starts, meta.prefill_q_lens,
                                                meta.prefill_context_lens, scale, out=out)
    start = nd
    block_size = k_cache.shape[1]
    group = q.shape[1] // k.shape[1]
    for q_len, ctx_len, table in zip(meta.prefill_q_lens, meta.prefill_context_lens,
                                     meta.prefill_block_tables):
        end = start + q_len
        qs = q[start:end].transpose(0, 1)  # [Hq, q_len, D]
        if ctx_len == q_len:  # nothing cached before this chunk: use the fresh K/V
            ks, vs = k[start:end], v[start:end]  # [q_len, Hkv, D]
            mask = None
        else:
            n_blocks = -(-ctx_len // block_size)
            # [ctx_len, Hkv, D] in q's dtype (a bf16 cache under float32 activations is widened)
            ks = k_cache.index_select(0, table[:n_blocks]).flatten(0, 1)[:ctx_len].to(q.dtype)
            vs = v_cache.index_select(0, table[:n_blocks]).flatten(0, 1)[:ctx_len].to(q.dtype)
            # query i sits at absolute position ctx_len - q_len + i and sees positions <= it
            q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
            mask = q_pos[:, None] >= torch.arange(ctx_len, device=q.device)[None, :]
        ks = ks.transpose(0, 1)  # [Hkv, ctx_len, D]
        vs = vs.transpose(0, 1)
        # batched 4-D inputs: on CPU the 3-D form misses torch's flash kernel and takes the slow path
        o = F.scaled_dot_product_attention(qs[None], ks[None], vs[None], attn_mask=mask, is_causal=mask is None,
                                           scale=scale, enable_gqa=group > 1)  # [1, Hq, q_len, D]
        out[start:end] = o[0].transpose(0, 1)
        start = end
    return out
