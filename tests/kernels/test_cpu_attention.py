"""The CPU decode attention (sorted groups + SDPA) against a naive per-token loop."""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_attention

from tests.support.paged_utils import make_paged, naive_decode

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3), (6, 1)])
def test_grouped_decode_vs_naive(dtype, hq, hkv):
    d, block_size = 8, 4
    # 19 sequences: more than two groups, unsorted lengths, an empty context, partial blocks
    lens = [7, 1, 30, 0, 5, 12, 3, 9, 16, 2, 21, 4, 11, 6, 8, 13, 1, 25, 10]
    k_cache, v_cache, bt, cl = make_paged(lens, block_size, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    out = cpu_attention.paged_decode_attention(q, k_cache, v_cache, bt, cl, d ** -0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert torch.all(out[3] == 0), "an empty context must give zeros, not NaN"
    torch.testing.assert_close(out.double(), naive_decode(q, k_cache, v_cache, bt, cl, d ** -0.5), **TOL[dtype])


def test_dispatcher_uses_grouped_path_when_native_is_off(monkeypatch):
    calls = []
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", lambda *a: calls.append(a) or a[0])
    k_cache, v_cache, bt, cl = make_paged([3], 4, 1, 8, torch.float32)
    q = torch.randn(1, 2, 8)
    kernels.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.5)
    assert len(calls) == 1
