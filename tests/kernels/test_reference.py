"""Torch reference kernels vs naive per-token loops, plus package/dispatch checks."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import reference as R

from tests.support.paged_utils import make_paged, naive_decode

REPO_ROOT = Path(__file__).resolve().parents[2]

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}


# --------------------------------------------------------------------------- #
# store_kv
# --------------------------------------------------------------------------- #


def naive_store(key, value, k_cache, v_cache, slots):
    bs = k_cache.shape[1]
    for i, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        k_cache[s // bs, s % bs] = key[i]
        v_cache[s // bs, s % bs] = value[i]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_store_kv_ref_vs_naive(dtype, slot_dtype):
    torch.manual_seed(0)
    nb, bs, hkv, d = 5, 4, 2, 8
    k_cache = torch.randn(nb, bs, hkv, d).to(dtype)
    v_cache = torch.randn(nb, bs, hkv, d).to(dtype)
    slots = torch.tensor([0, -1, 7, 19, -1, 12, 5], dtype=slot_dtype)
    # key/value as non-contiguous slices of a fused qkv-like tensor
    kv = torch.randn(len(slots), 2, hkv, d).to(dtype)
    key, value = kv[:, 0], kv[:, 1]
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    naive_store(key, value, k_exp, v_exp, slots)
    R.store_kv(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache, k_exp)
    assert torch.equal(v_cache, v_exp)


def test_store_kv_ref_all_skipped_and_empty():
    k_cache = torch.randn(2, 4, 1, 4)
    v_cache = torch.randn(2, 4, 1, 4)
    k0, v0 = k_cache.clone(), v_cache.clone()
    R.store_kv(torch.ones(2, 1, 4), torch.ones(2, 1, 4), k_cache, v_cache, torch.tensor([-1, -1]))
    R.store_kv(torch.ones(0, 1, 4), torch.ones(0, 1, 4), k_cache, v_cache, torch.tensor([], dtype=torch.long))
    assert torch.equal(k_cache, k0) and torch.equal(v_cache, v0)


# --------------------------------------------------------------------------- #
# paged_decode_attention
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hq,hkv", [(4, 2), (3, 3), (6, 1)])
@pytest.mark.parametrize("block_size", [4, 3])
def test_decode_ref_vs_naive(dtype, hq, hkv, block_size):
    d = 8
    lens = [1, 6, 9, 4]  # not multiples of block_size, one spanning a partial block
    k_cache, v_cache, bt, cl = make_paged(lens, block_size, hkv, d, dtype)
    q = torch.randn(len(lens), hq, d).to(dtype)
    scale = d**-0.5
    out = R.paged_decode_attention(q, k_cache, v_cache, bt, cl, scale)
    assert out.dtype == dtype and out.shape == q.shape
    exp = naive_decode(q, k_cache, v_cache, bt, cl, scale)
    torch.testing.assert_close(out.double(), exp, **TOL[dtype])


def test_decode_ref_empty_context_is_zero():
    k_cache, v_cache, bt, cl = make_paged([0, 5], 4, 2, 8, torch.float32)
    q = torch.randn(2, 4, 8)
    out = R.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.3)
    assert torch.all(out[0] == 0)
    torch.testing.assert_close(out[1].double(), naive_decode(q, k_cache, v_cache, bt, cl, 0.3)[1])


# --------------------------------------------------------------------------- #
# gather_blocks / scatter_blocks
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("shape", [(6, 4, 2, 8), (6, 10)])
def test_gather_scatter_ref_vs_naive(shape):
    torch.manual_seed(0)
    cache = torch.randn(*shape)
    ids = torch.tensor([4, 0, 2], dtype=torch.long)
    buf = R.gather_blocks(cache, ids)
    assert buf.is_contiguous() and buf.shape == (3,) + shape[1:]
    assert torch.equal(buf, torch.stack([cache[i] for i in ids.tolist()]))

    new = torch.randn_like(buf)
    exp = cache.clone()
    for j, i in enumerate(ids.tolist()):
        exp[i] = new[j]
    R.scatter_blocks(cache, ids, new)
    assert torch.equal(cache, exp)
    # round trip
    assert torch.equal(R.gather_blocks(cache, ids), new)


# --------------------------------------------------------------------------- #
# package / dispatcher
# --------------------------------------------------------------------------- #


def test_import_and_cpu_calls_do_not_import_triton():
    code = (
        "import sys\n"
        "from pdserve import kernels\n"
        "assert 'triton' not in sys.modules, 'triton imported'\n"
        "import torch\n"
        "assert kernels.triton_available() in (True, False)\n"
        "kc = torch.zeros(2, 4, 1, 4)\n"
        "kernels.store_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), kc, kc.clone(), torch.tensor([3]))\n"
        "bt = torch.tensor([[0]], dtype=torch.int32)\n"
        "kernels.paged_decode_attention(torch.ones(1, 1, 4), kc, kc, bt, torch.tensor([4]), 1.0)\n"
        "kernels.scatter_blocks(kc, torch.tensor([1]), kernels.gather_blocks(kc, torch.tensor([0])))\n"
        "assert 'triton' not in sys.modules, 'triton imported by CPU calls'\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr


def test_public_api():
    for name in [
        "store_kv",
        "paged_decode_attention",
            "gather_blocks",
        "scatter_blocks",
        "triton_store_kv",
        "triton_paged_decode_attention",
        "triton_gather_blocks",
        "triton_scatter_blocks",
        "use_triton",
    ]:
        assert callable(getattr(kernels, name)), name
    assert kernels.reference is R


def test_dispatch_cpu_goes_to_reference(monkeypatch):
    assert not kernels.use_triton(torch.zeros(1))
    calls = []

    def spy(name):
        real = getattr(R, name)

        def f(*a, **k):
            calls.append(name)
            return real(*a, **k)

        return f

    def boom(*a, **k):
        raise AssertionError("triton path used for CPU tensors")

    for name in ["store_kv", "paged_decode_attention", "gather_blocks", "scatter_blocks"]:
        monkeypatch.setattr(R, name, spy(name))
        monkeypatch.setattr(kernels, "triton_" + name, boom)
    # on CPU, float32 decode attention and the KV store go to the native CPU kernels, not the reference
    from pdserve.kernels import cpu_native
    real_cpu, real_store = cpu_native.paged_decode_attention, cpu_native.store_kv
    monkeypatch.setattr(cpu_native, "paged_decode_attention",
                        lambda *a: calls.append("cpu_paged_decode_attention") or real_cpu(*a))
    monkeypatch.setattr(cpu_native, "store_kv", lambda *a: calls.append("cpu_store_kv") or real_store(*a))

    k_cache, v_cache, bt, cl = make_paged([3], 4, 1, 4, torch.float32)
    kernels.store_kv(torch.ones(1, 1, 4), torch.ones(1, 1, 4), k_cache, v_cache, torch.tensor([2]))
    kernels.paged_decode_attention(torch.randn(1, 2, 4), k_cache, v_cache, bt, cl, 0.5)
    buf = kernels.gather_blocks(k_cache, torch.tensor([0]))
    kernels.scatter_blocks(k_cache, torch.tensor([1]), buf)
    assert calls == ["cpu_store_kv", "cpu_paged_decode_attention", "gather_blocks", "scatter_blocks"]
    kernels.store_kv(torch.ones(1, 1, 4, dtype=torch.float16), torch.ones(1, 1, 4, dtype=torch.float16),
                     k_cache.half(), v_cache.half(), torch.tensor([2]))
    assert calls[-1] == "store_kv"  # other dtypes: the reference


def test_dispatch_routes_to_triton_when_enabled(monkeypatch):
    calls = []
    for name in ["store_kv", "paged_decode_attention", "gather_blocks", "scatter_blocks"]:
        monkeypatch.setattr(kernels, "triton_" + name, lambda *a, _n=name, **k: calls.append(_n))
    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    x = torch.zeros(2, 4, 1, 4)
    kernels.store_kv(x[0], x[0], x, x, torch.tensor([0]))
    kernels.paged_decode_attention(x[0], x, x, torch.zeros(4, 1, dtype=torch.int32), torch.ones(4), 1.0)
    kernels.gather_blocks(x, torch.tensor([0]))
    kernels.scatter_blocks(x, torch.tensor([0]), x[:1])
    assert calls == ["store_kv", "paged_decode_attention", "gather_blocks", "scatter_blocks"]


def test_disable_env_var(monkeypatch):
    monkeypatch.setattr(kernels, "triton_available", lambda: True)

    class FakeCuda:
        is_cuda = True

    assert kernels.use_triton(FakeCuda())
    monkeypatch.setenv("PDSERVE_DISABLE_TRITON", "1")
    assert not kernels.use_triton(FakeCuda())
