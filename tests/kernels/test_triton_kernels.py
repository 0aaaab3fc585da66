"""Triton kernels vs the torch references.

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, which must be
set before the Triton kernels are first defined), so sizes are kept tiny. Only
fp32/fp16: bf16 is not reliable under the interpreter.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference as R

from tests.support.paged_utils import make_paged

pytest.importorskip("triton")

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET", "0") in ("", "0") else "cpu"
if DEVICE == "cuda" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 or a CUDA device", allow_module_level=True)

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=1e-3, rtol=1e-3)}
DTYPES = [torch.float32, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_triton(dtype, slot_dtype):
    torch.manual_seed(0)
    nb, bs, hkv, d = 5, 4, 3, 12  # non power-of-2 heads and head_dim
    k_cache = torch.randn(nb, bs, hkv, d, device=DEVICE).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d, device=DEVICE).to(dtype)
    slots = torch.tensor([0, -1, 7, 19, -1, 12, 5], dtype=slot_dtype, device=DEVICE)
    kv = torch.randn(len(slots), 2, hkv, d, device=DEVICE).to(dtype)
    key, value = kv[:, 0], kv[:, 1]  # non-contiguous views
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    R.store_kv(key, value, k_ref, v_ref, slots)
    kernels.triton_store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_ref)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "hq,hkv,block_size,d",
    [
        (4, 2, 4, 16),  # GQA group 2
        (6, 2, 4, 12),  # group 3 (non power of 2), head_dim 12
        (2, 2, 3, 8),  # MHA, non power-of-2 block size
    ],
)
def test_paged_decode_triton(dtype, hq, hkv, block_size, d):
    lens = [1, 6, 9, 0]  # partial blocks, and an empty (padding) sequence
    k_cache, v_cache, bt, cl = make_paged(lens, block_size, hkv, d, dtype, pad_cols=2)
    k_cache, v_cache, bt, cl = (t.to(DEVICE) for t in (k_cache, v_cache, bt, cl))
    q = torch.randn(len(lens), hq, d, device=DEVICE).to(dtype)
    scale = d**-0.5
    ref = R.paged_decode_attention(q, k_cache, v_cache, bt, cl, scale)
    out = kernels.triton_paged_decode_attention(q, k_cache, v_cache, bt, cl, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.float(), ref.float(), **TOL[dtype])
    assert torch.all(out[3] == 0)


def test_paged_decode_triton_noncontiguous_q():
    hq, hkv, d = 4, 2, 8
    k_cache, v_cache, bt, cl = make_paged([5, 8], 4, hkv, d, torch.float32)
    k_cache, v_cache, bt, cl = (t.to(DEVICE) for t in (k_cache, v_cache, bt, cl))
    qkv = torch.randn(2, hq + 2 * hkv, d, device=DEVICE)
    q = qkv[:, :hq]  # view into a fused qkv tensor
    ref = R.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.4)
    out = kernels.triton_paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.4)
    torch.testing.assert_close(out, ref, **TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(6, 4, 2, 8), (5, 4100)])  # 2nd: >1 chunk per block
def test_gather_scatter_triton(dtype, shape):
    torch.manual_seed(0)
    cache = torch.randn(*shape, device=DEVICE).to(dtype)
    ids = torch.tensor([4, 0, 2], dtype=torch.long, device=DEVICE)
    buf = kernels.triton_gather_blocks(cache, ids)
    assert buf.is_contiguous() and buf.dtype == dtype
    assert torch.equal(buf, R.gather_blocks(cache, ids))

    new = torch.randn_like(buf)
    exp = cache.clone()
    R.scatter_blocks(exp, ids, new)
    kernels.triton_scatter_blocks(cache, ids, new)
    assert torch.equal(cache, exp)
