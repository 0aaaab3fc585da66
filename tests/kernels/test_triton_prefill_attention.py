"""The Triton varlen prefill attention (kernels/prefill_attention.py) against its torch
reference (kernels.reference.paged_prefill_attention) and against SDPA, and the reference
against SDPA and the native CPU kernel.

Runs through Triton's interpreter on CPU tensors (TRITON_INTERPRET=1, set by the tests'
conftest before any kernel is defined), at float32 only: the interpreter's tl.dot is wrong
on bf16. Sizes stay small: the interpreter runs each program in numpy. With
TRITON_INTERPRET=0 on a GPU the same tests run the compiled kernel.

Every case is several sequences in one call, after a few leading rows (decode tokens) the
kernel must leave alone: chunks of 1..N tokens, fresh or after a cached prefix of a
length that does or does not end on a block edge, GQA groups of 1, 2, 3 (padded to 4), 4
and 8, head_dim 64 and 128.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.kernels import cpu_native
from pdserve.kernels import reference as R

pytest.importorskip("triton")

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

LEAD = 3  # leading rows that are not the chunks' (a step's decode tokens)
# (q_len, ctx_len): fresh prompts (q == ctx), chunks after a prefix ending on a block edge
# (ctx - q = 32) and off one (19, 45), chunks of one token, and one longer than a tile
CHUNKS = [(5, 5), (1, 33), (7, 39), (16, 35), (1, 1), (26, 71), (70, 70)]


def paged_setup(chunks, hq, hkv, d, block_size, dtype=torch.float32, seed=0):
    """Random caches holding every sequence's whole context (prefix and chunk: the engine
    stores a chunk's K/V before attention), shuffled block tables (-1 padded), q with LEAD
    leading rows as a strided view into a fused qkv, cu_seqlens_q and context_lens."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-ctx // block_size) for _, ctx in chunks]
    num_blocks = sum(need) + 2
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(chunks), max(need) + 1), -1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[used:used + n].to(torch.int32)
        used += n
    rows = LEAD + sum(ql for ql, _ in chunks)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=g).to(dtype)
    q = qkv[:, :hq * d].view(rows, hq, d)
    cu = torch.tensor([LEAD + sum(ql for ql, _ in chunks[:i]) for i in range(len(chunks) + 1)], dtype=torch.int32)
    ctx = torch.tensor([c for _, c in chunks], dtype=torch.int32)
    return [t.to(DEVICE) for t in (q, k_cache, v_cache, tables, cu, ctx)]


def sdpa(q, k_cache, v_cache, tables, cu, ctx, scale):
    """Each chunk by torch's scaled_dot_product_attention over its gathered context, with
    the causal mask of its positions: [rows of the chunks, Hq, D] float32."""
    outs = []
    bs = k_cache.shape[1]
    for p, c in enumerate(ctx.tolist()):
        start, end = int(cu[p]), int(cu[p + 1])
        blocks = tables[p, :-(-c // bs)].long()
        ks = k_cache[blocks].flatten(0, 1)[:c].transpose(0, 1).float()  # [Hkv, ctx, D]
        vs = v_cache[blocks].flatten(0, 1)[:c].transpose(0, 1).float()
        pos = torch.arange(c - (end - start), c, device=q.device)
        mask = pos[:, None] >= torch.arange(c, device=q.device)[None, :]
        o = F.scaled_dot_product_attention(q[start:end].transpose(0, 1)[None].float(), ks[None], vs[None],
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(o[0].transpose(0, 1))
    return torch.cat(outs)


@pytest.mark.parametrize("hq,hkv,d,block_size", [
    (4, 4, 64, 16),    # no GQA
    (8, 4, 64, 16),    # group 2
    (6, 2, 64, 16),    # group 3: padded to 4 rows per token
    (8, 2, 128, 16),   # group 4 (Llama-3 / Qwen3 8B), head_dim 128
    (8, 1, 128, 8),    # group 8, another block size
])
def test_triton_matches_reference_and_sdpa(hq, hkv, d, block_size):
    q, k_cache, v_cache, tables, cu, ctx = paged_setup(CHUNKS, hq, hkv, d, block_size, seed=hq + d)
    scale = d ** -0.5
    max_q = max(ql for ql, _ in CHUNKS)
    out = torch.full_like(q, 7.0)
    got = kernels.triton_paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max_q, scale, out=out)
    assert got is out
    assert torch.equal(out[:LEAD], torch.full_like(out[:LEAD], 7.0))  # the leading rows untouched
    ref = R.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, max_q, scale)
    torch.testing.assert_close(out[LEAD:], ref[LEAD:], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out[LEAD:], sdpa(q, k_cache, v_cache, tables, cu, ctx, scale), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("q_len", [1, 2, 15, 16, 17, 40])
def test_triton_every_chunk_length_after_a_partial_block_prefix(q_len):
    """One sequence, a prefix of 21 tokens (a block and 5), then chunks of 1..40."""
    chunks = [(q_len, 21 + q_len)]
    q, k_cache, v_cache, tables, cu, ctx = paged_setup(chunks, 8, 2, 64, 16, seed=q_len)
    out = kernels.triton_paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, q_len, 0.125)
    torch.testing.assert_close(out[LEAD:], sdpa(q, k_cache, v_cache, tables, cu, ctx, 0.125), atol=2e-5, rtol=2e-5)


def test_triton_max_q_len_larger_than_every_chunk_changes_nothing():
    """The grid is sized by the host's max_q_len; tiles past a chunk's end exit."""
    q, k_cache, v_cache, tables, cu, ctx = paged_setup(CHUNKS[:3], 4, 2, 64, 16)
    a = kernels.triton_paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 7, 0.1)
    b = kernels.triton_paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 200, 0.1)
    assert torch.equal(a, b)


def test_reference_matches_sdpa_and_the_native_cpu_kernel():
    q, k_cache, v_cache, tables, cu, ctx = (t.cpu() for t in paged_setup(CHUNKS, 8, 2, 64, 16, seed=5))
    ref = R.paged_prefill_attention(q, k_cache, v_cache, tables, cu, ctx, 70, 0.125)
    torch.testing.assert_close(ref[LEAD:], sdpa(q, k_cache, v_cache, tables, cu, ctx, 0.125), atol=1e-5, rtol=1e-5)
    assert torch.equal(ref[:LEAD], torch.zeros_like(ref[:LEAD]))
    if cpu_native.library() is None:
        pytest.fail("the native kernels did not build (is a C compiler installed?)")
    native = cpu_native.prefill_attention(q, k_cache, v_cache, tables, cu[:-1].tolist(), (cu[1:] - cu[:-1]).tolist(),
                                          ctx.tolist(), 0.125, out=torch.zeros(q.shape))
    torch.testing.assert_close(native[LEAD:], ref[LEAD:], atol=1e-5, rtol=1e-5)
