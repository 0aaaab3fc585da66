"""The bf16 KV cache's native kernels: store_kv rounds to nearest even (torch's own
conversion, bit for bit), and decode and prefill attention over a bf16 cache (K and V
widened as they are read, exactly) give the float32 kernels' bits on the widened cache."""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_native, reference

from tests.support.paged_utils import make_paged, naive_decode, with_threads


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_store_kv_rounds_as_torch(threads, n):
    hkv, d, bs, blocks = 3, 40, 16, 40
    g = torch.Generator().manual_seed(n)
    key, value = torch.randn(n, hkv, d, generator=g) * 10, torch.randn(n, hkv, d, generator=g)
    # ties (low half exactly 0x8000, odd and even), NaN, inf, -0, the largest float
    special = torch.tensor([0x3f808000, 0x3f818000, 0x7fc00001, 0x7f800000, 0x80000000, 0x7f7fffff, 0x00008000,
                            0xff800000], dtype=torch.int64).to(torch.int32).view(torch.float32)
    key.view(-1)[:len(special)] = special
    slots = torch.randperm(blocks * bs, generator=g)[:n]
    slots[::5] = -1  # skipped
    caches = [kv.permute(0, 2, 1, 3) for kv in torch.zeros(4, blocks, hkv, bs, d, dtype=torch.bfloat16)]  # head-major
    got_k, got_v, want_k, want_v = caches
    assert cpu_native.supports_store_kv(key, value, got_k, got_v)
    with_threads(threads, lambda: kernels.store_kv(key, value, got_k, got_v, slots))
    reference.store_kv(key, value, want_k, want_v, slots)  # torch's float -> bfloat16
    assert torch.equal(got_k.view(torch.int16), want_k.view(torch.int16))
    assert torch.equal(got_v.view(torch.int16), want_v.view(torch.int16))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 8), (8, 1, 32), (9, 3, 64), (6, 2, 128), (4, 1, 24), (2, 2, 20)])
@pytest.mark.parametrize("lens", [[7, 1, 30, 0, 5, 12, 3, 9, 16, 2, 21, 4, 11, 6, 8, 13, 1, 25, 10], [40, 0], [300, 129]])
def test_decode_attention_over_bf16_is_float32_over_the_widened_cache(threads, hq, hkv, d, lens):
    k_cache, v_cache, bt, cl = make_paged(lens, 16, hkv, d, torch.bfloat16, seed=len(lens) + d)
    q = torch.randn(len(lens), hq, d)
    assert cpu_native.supports(q, k_cache, v_cache)
    got = with_threads(threads, lambda: kernels.paged_decode_attention(q, k_cache, v_cache, bt, cl, d ** -0.5))
    want = with_threads(threads, lambda: cpu_native.paged_decode_attention(q, k_cache.float(), v_cache.float(), bt,
                                                                           cl, d ** -0.5))
    if d % 8 == 0:  # the vector loops: the same fused multiply-adds on the same values
        assert torch.equal(got, want)
    else:  # the plain C loop, which -ffast-math vectorizes in its own order per element type
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.double(), naive_decode(q, k_cache.float(), v_cache.float(), bt, cl, d ** -0.5),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("hq,hkv,d,block_size", [(8, 4, 64, 16), (6, 2, 32, 5), (3, 1, 16, 7)])
def test_prefill_attention_over_bf16_is_float32_over_the_widened_cache(hq, hkv, d, block_size):
    g = torch.Generator().manual_seed(hq + d + block_size)
    chunks = [(37, 37), (100, 260), (1, 50), (49, 113)]  # (q_len, ctx_len)
    num_blocks = sum(-(-c // block_size) for _, c in chunks) + 3
    k_cache = (torch.randn(num_blocks, block_size, hkv, d, generator=g) * 2).to(torch.bfloat16)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(torch.bfloat16)
    perm = torch.randperm(num_blocks, generator=g).to(torch.int32)
    table = torch.full((len(chunks), num_blocks), -1, dtype=torch.int32)
    used = 0
    for i, (_, ctx) in enumerate(chunks):
        n = -(-ctx // block_size)
        table[i, :n] = perm[used:used + n]
        used += n
    rows = sum(ql for ql, _ in chunks)
    q = torch.randn(rows, hq, d, generator=g)
    starts = [sum(ql for ql, _ in chunks[:i]) for i in range(len(chunks))]
    args = (table, starts, [ql for ql, _ in chunks], [c for _, c in chunks], d ** -0.5)
    assert cpu_native.supports_prefill(q, k_cache, v_cache)
    got = cpu_native.prefill_attention(q, k_cache, v_cache, *args)
    assert torch.equal(got, cpu_native.prefill_attention(q, k_cache.float(), v_cache.float(), *args))


def test_torch_fallbacks_read_a_bf16_cache(monkeypatch):
    """With the native kernels off, a bf16 cache under float32 queries still works."""
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    k_cache, v_cache, bt, cl = make_paged([9, 30], 8, 2, 16, torch.bfloat16)
    q = torch.randn(2, 4, 16)
    got = kernels.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.25)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.double(), naive_decode(q, k_cache.float(), v_cache.float(), bt, cl, 0.25),
                               atol=1e-5, rtol=1e-5)
