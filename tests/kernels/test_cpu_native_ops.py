"""The native CPU ops besides attention, each against a float64 torch reference:
`kernels.linear` (the few-rows kernel, kernels/csrc/small_linear_cpu.c, and oneDNN on a
packed weight, with the dispatch and the layer's re-packing after a weight is written),
and the fused elementwise steps (kernels/csrc/elementwise_cpu.c)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernels
from common.models.layers import Linear
from kernels import cpu_native


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


def expected(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("n,k", [(4, 8), (7, 13), (33, 64), (130, 77), (9, 3)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_linear_vs_float64(threads, m, n, k, with_bias):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if with_bias else None
        torch.testing.assert_close(cpu_native.small_linear(x, w, b), expected(x, w, b), rtol=1e-5, atol=1e-5)
    finally:
        torch.set_num_threads(before)


def test_small_linear_strided_rows():
    """Rows of x and of the weight further apart than k (views into wider tensors)."""
    x_wide, w_wide = torch.randn(3, 40), torch.randn(21, 50)
    x, w = x_wide[:, 5:29], w_wide[:, 10:34]
    assert x.stride(0) == 40 and w.stride(0) == 50
    torch.testing.assert_close(cpu_native.small_linear(x, w), expected(x, w, None), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 8, 9, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_dispatch_matches_float64(m, with_bias):
    """Whatever path a row count takes (native, packed oneDNN), the product is right."""
    x, w = torch.randn(m, 96), torch.randn(70, 96)
    b = torch.randn(70) if with_bias else None
    packed = kernels.pack_linear_weight(w)
    assert packed is not None, "oneDNN is part of the CPU torch build"
    torch.testing.assert_close(kernels.linear(x, w, b, packed), expected(x, w, b), rtol=1e-4, atol=1e-4)


def test_dispatch_routes_by_rows(monkeypatch):
    calls = []
    real_small = cpu_native.small_linear
    monkeypatch.setattr(cpu_native, "small_linear", lambda *a: calls.append("native") or real_small(*a))
    w = torch.randn(16, 32)
    packed = kernels.pack_linear_weight(w)
    kernels.linear(torch.randn(cpu_native.SMALL_LINEAR_MAX_ROWS, 32), w, None, packed)
    kernels.linear(torch.randn(cpu_native.SMALL_LINEAR_MAX_ROWS + 1, 32), w, None, packed)
    assert calls == ["native"]
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")  # the switch that turns the native kernels off
    kernels.linear(torch.randn(1, 32), w, None, packed)
    assert calls == ["native"]


def test_no_packing_off_cpu_float32(monkeypatch):
    assert kernels.pack_linear_weight(torch.randn(4, 4, dtype=torch.float64)) is None
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "torch")
    assert kernels.pack_linear_weight(torch.randn(4, 4)) is None


def test_layer_repacks_after_weight_written():
    """A weight loaded or edited after the first forward must not leave a stale packed copy."""
    layer = Linear(24, 10, bias=True)
    x = torch.randn(20, 24)  # enough rows for the packed path
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        layer.weight.copy_(torch.randn(10, 24))
        torch.testing.assert_close(layer(x), expected(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


def rms_norm64(h, w, eps):
    h = h.double()
    return (w.double() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps))).float()


@pytest.mark.parametrize("rows", [1, 3, 70])  # 70 x 576 is over the threshold where two threads split the rows
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_vs_float64(rows, with_residual):
    x_wide = torch.randn(rows, 600)
    x = x_wide[:, :576]  # rows further apart than dim
    residual = torch.randn(rows, 576) if with_residual else None
    w = torch.randn(576)
    out, h = cpu_native.add_rms_norm(x, residual, w, 1e-6)
    want_h = x if residual is None else x + residual
    assert torch.equal(h, want_h)  # the residual stream's add is exact
    torch.testing.assert_close(out, rms_norm64(want_h, w, 1e-6), rtol=1e-5, atol=1e-5)
    # and the dispatcher's torch path (what a GPU or bfloat16 runs) agrees
    ref_out, ref_h = kernels.add_rms_norm(x.double(), None if residual is None else residual.double(), w.double(), 1e-6)
    torch.testing.assert_close(out, ref_out.float(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 4, 40])
def test_silu_mul_vs_float64(rows):
    gate_up = torch.randn(rows, 2 * 1536) * 4
    g, u = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(cpu_native.silu_mul(gate_up), (F.silu(g) * u).float(), rtol=1e-5, atol=1e-5)


def test_elementwise_refuses_bad_shapes():
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.silu_mul(torch.randn(2, 0))
