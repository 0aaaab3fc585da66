"""The attention kernels alone, one layer at the model's geometry, each against what it is
checked by:

- prefill on the mixed batch with cached prefixes: the kernel the engine now calls (on CUDA
  the Triton varlen kernel, every chunk in one launch over the paged cache; on the CPU the
  native kernel) against what it replaced on CUDA, SDPA one chunk at a time over its
  gathered context with a dense mask (`common.models.attention.sdpa_prefill`);
- decode of a batch at a context: the engine's decode attention (`kernels.paged_decode_attention`:
  the split Triton kernel on CUDA) against the torch reference, with the KV bytes it read
  per second (the figure decode at large batches is bound by).

Outputs compared (max abs difference), both timed."""
from __future__ import annotations

import numpy as np
import torch

from benchmarks.gpu.limits import best_seconds
from pdserve import kernels
from pdserve.common.engine.model_runner import prefill_metadata
from pdserve.common.models.attention import sdpa_prefill
from pdserve.kernels import cpu_native, reference


def prefill(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
            chunks: list[tuple[int, int]], reps: int = 5) -> dict:
    """`chunks`: (q_len, context_len) per sequence, each context holding its chunk."""
    g = torch.Generator(device=device).manual_seed(0)
    need = [-(-ctx // block_size) for _, ctx in chunks]
    k_cache = torch.randn(sum(need), block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v_cache = torch.randn(sum(need), block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
    starts = np.cumsum([0, *need])
    tables = [list(range(int(a), int(b))) for a, b in zip(starts, starts[1:])]
    q_lens = [q for q, _ in chunks]
    pre = prefill_metadata(q_lens, [c for _, c in chunks], tables, 0, device)
    rows = sum(q_lens)
    q = torch.randn(rows, heads, head_dim, generator=g, device=device).to(dtype)
    # the chunks' own K/V, as the layer has them (the SDPA path reads them for a fresh prompt)
    slots = []
    for table, (ql, c) in zip(tables, chunks):
        pos = np.arange(c - ql, c)
        slots.append(np.asarray(table)[pos // block_size] * block_size + pos % block_size)
    slots = torch.from_numpy(np.concatenate(slots)).to(device)
    k = k_cache.flatten(0, 1)[slots]
    v = v_cache.flatten(0, 1)[slots]
    scale = head_dim ** -0.5
    starts_q = [sum(q_lens[:i]) for i in range(len(q_lens))]
    old = lambda: sdpa_prefill(q, k, v, k_cache, v_cache, pre, starts_q, scale, torch.empty_like(q))  # noqa: E731
    if device.type == "cuda":
        name = "triton_varlen"
        new = lambda: kernels.triton_paged_prefill_attention(q, k_cache, v_cache, pre.block_tables,  # noqa: E731
                                                             pre.cu_seqlens_q, pre.context_lens_t, pre.max_q_len,
                                                             scale)
    elif cpu_native.supports_prefill(q, k_cache, v_cache):
        name = "cpu_native"
        new = lambda: cpu_native.prefill_attention(q, k_cache, v_cache, pre.block_tables, starts_q, q_lens,  # noqa: E731
                                                   pre.context_lens, scale)
    else:
        return {"skipped": f"no one-call prefill kernel for {dtype} on {device}"}
    diff = float((new().float() - old().float()).abs().max())
    t_new, t_old = best_seconds(new, device, reps), best_seconds(old, device, reps)
    flops = sum(4 * heads * head_dim * ql * (c - ql + (ql + 1) / 2) for ql, c in chunks)
    return {"kernel": name, "kernel_ms": t_new * 1e3, "sdpa_loop_ms": t_old * 1e3, "speedup": t_old / t_new,
            "kernel_tflops": flops / t_new / 1e12, "max_abs_diff": diff, "chunks": chunks}


def decode(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, block_size: int,
           batch: int, context: int, reps: int = 5) -> dict:
    """`batch` sequences of `context` tokens each, their own blocks."""
    g = torch.Generator(device=device).manual_seed(1)
    per_seq = -(-context // block_size)
    k_cache = torch.randn(batch * per_seq, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
    v_cache = torch.randn(batch * per_seq, block_size, kv_heads, head_dim, generator=g, device=device).to(dtype)
    tables = torch.randperm(batch * per_seq, generator=g, device=device).view(batch, per_seq).to(torch.int32)
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, heads, head_dim, generator=g, device=device).to(dtype)
    scale = head_dim ** -0.5
    ours = lambda: kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
    ref = lambda: reference.paged_decode_attention(q, k_cache, v_cache, tables, lens, scale)  # noqa: E731
    diff = float((ours().float() - ref().float()).abs().max())
    t_ours, t_ref = best_seconds(ours, device, reps), best_seconds(ref, device, reps)
    kv_bytes = 2 * batch * context * kv_heads * head_dim * k_cache.element_size()
    return {"batch": batch, "context": context, "kernel_ms": t_ours * 1e3, "reference_ms": t_ref * 1e3,
            "kv_gb_per_s": kv_bytes / t_ours / 1e9, "max_abs_diff": diff}
