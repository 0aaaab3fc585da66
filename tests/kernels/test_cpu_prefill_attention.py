"""The native causal prefill attention (kernels/csrc/prefill_attention_cpu.c) against a
float64 torch reference: prompt chunks that start fresh or continue a cached context,
GQA groups of 1-3, block sizes that do and do not divide the lengths, in one call; and
the refusals of a bad block table. The engine's greedy output against transformers goes
through it too (tests/common)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.kernels import cpu_native


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


def reference(q, k_cache, v_cache, table, q_len, ctx_len, scale):
    """[q_len, Hq, D] in float64: the chunk's queries over keys 0 ..= their own position."""
    ks = k_cache[table.long()].flatten(0, 1)[:ctx_len].transpose(0, 1).double()  # [Hkv, ctx, D]
    vs = v_cache[table.long()].flatten(0, 1)[:ctx_len].transpose(0, 1).double()
    pos = torch.arange(ctx_len - q_len, ctx_len)
    mask = pos[:, None] >= torch.arange(ctx_len)[None, :]
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None].double(), ks[None], vs[None], attn_mask=mask,
                                       scale=scale, enable_gqa=True)
    return o[0].transpose(0, 1)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(4, 4, 32, 16), (8, 4, 64, 16), (6, 2, 32, 5), (3, 1, 16, 7)])
def test_matches_float64(hq, hkv, d, block_size):
    g = torch.Generator().manual_seed(hq * 100 + d + block_size)
    chunks = [(37, 37), (100, 260), (5, 5), (1, 50), (130, 130), (64, 64), (49, 113)]  # (q_len, ctx_len)
    num_blocks = sum(-(-c // block_size) for _, c in chunks) + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g) * 2
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables, used = [], 0
    for _, ctx in chunks:
        n = -(-ctx // block_size)
        tables.append(perm[used:used + n].to(torch.int32))
        used += n
    table = torch.full((len(chunks), max(len(t) for t in tables)), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    n_rows = 3 + sum(ql for ql, _ in chunks)  # 3 leading rows (decode tokens) the kernel leaves alone
    qkv = torch.randn(n_rows, (hq + 2 * hkv) * d, generator=g) * 2  # q is a strided view, as in the model
    q = qkv[:, :hq * d].view(n_rows, hq, d)
    starts = [3 + sum(ql for ql, _ in chunks[:i]) for i in range(len(chunks))]
    out = torch.full((n_rows, hq, d), 7.0)
    cpu_native.prefill_attention(q, k_cache, v_cache, table, starts, [ql for ql, _ in chunks],
                                 [c for _, c in chunks], d ** -0.5, out=out)
    assert torch.equal(out[:3], torch.full((3, hq, d), 7.0))
    for (ql, ctx), start, t in zip(chunks, starts, tables):
        want = reference(q[start:start + ql], k_cache, v_cache, t, ql, ctx, d ** -0.5)
        torch.testing.assert_close(out[start:start + ql].double(), want, rtol=1e-4, atol=1e-5)  # float32 sums


def test_refuses_a_bad_block_table():
    k_cache = torch.randn(4, 16, 2, 16)
    q = torch.randn(20, 2, 16)
    with pytest.raises(cpu_native.NativeKernelError, match="bad arguments"):  # block 9 is outside the cache
        cpu_native.prefill_attention(q, k_cache, k_cache, torch.tensor([[0, 9]], dtype=torch.int32), [0], [20], [20],
                                     0.25)
    with pytest.raises(cpu_native.NativeKernelError, match="bad arguments"):  # a context past its table
        cpu_native.prefill_attention(q, k_cache, k_cache, torch.tensor([[0]], dtype=torch.int32), [0], [20], [20], 0.25)
    with pytest.raises(ValueError, match="outside q"):
        cpu_native.prefill_attention(q, k_cache, k_cache, torch.tensor([[0, 1]], dtype=torch.int32), [5], [20], [20],
                                     0.25)
