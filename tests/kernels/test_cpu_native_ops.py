"""The native CPU ops besides attention, each against a float64 torch reference: the
packed GEMM behind every linear layer (kernels/csrc/gemm_cpu.c through
`kernels.LinearPlan`, with the layer's re-packing after a weight is written and the
fallbacks when it is off), and the fused elementwise steps (kernels/csrc/elementwise_cpu.c)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.common.models.layers import Linear, RotaryEmbedding
from pdserve.common.engine.kv_layout import kv_cache_tensor
from pdserve.kernels import cpu_native, reference


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


def expected(x, w, b):
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("threads", [1, 2])
# rows: under, at and past the register tile (6 rows on AVX2, 8 on AVX-512) and the
# 96-row block; columns: under, at and past a 16-column panel and a pair of them (odd
# panel counts leave one alone); k: under and past the 192-long panel slice
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 8, 9, 13, 97, 200])
@pytest.mark.parametrize("n,k", [(4, 8), (16, 13), (33, 64), (130, 77), (9, 3), (40, 1100)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_gemm_vs_float64(threads, m, n, k, with_bias):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
        x = torch.randn(m, k, generator=g)
        w = torch.randn(n, k, generator=g)
        b = torch.randn(n, generator=g) if with_bias else None
        got = cpu_native.gemm(x, cpu_native.pack_weight(w), n, b)
        torch.testing.assert_close(got, expected(x, w, b), rtol=1e-4, atol=1e-4 * k ** 0.5)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("k", [64, 300, 1100])
def test_gemm_row_does_not_depend_on_its_batch(k):
    """Every output is one chain of fused multiply-adds whatever tile, block, thread or
    batch its row falls in: a sequence's logits do not change with who shares its step."""
    g = torch.Generator().manual_seed(k)
    x, w, b = torch.randn(203, k, generator=g), torch.randn(77, k, generator=g), torch.randn(77, generator=g)
    packed = cpu_native.pack_weight(w)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = cpu_native.gemm(x, packed, 77, b)
        torch.set_num_threads(1)
        # 1 to 5 rows: pair tiles from two streams (float32, AVX2)
        for lo, hi in [(0, 1), (5, 6), (20, 22), (30, 33), (40, 44), (50, 55), (7, 16), (100, 203), (96, 97)]:
            assert torch.equal(cpu_native.gemm(x[lo:hi], packed, 77, b), whole[lo:hi])
    finally:
        torch.set_num_threads(before)


def test_gemm_strided_rows():
    """Rows of x further apart than k (a view into a wider tensor); a weight that is a
    strided view packs like its copy."""
    x_wide, w_wide = torch.randn(3, 40), torch.randn(21, 50)
    x, w = x_wide[:, 5:29], w_wide[:, 10:34]
    assert x.stride(0) == 40 and w.stride(0) == 50
    torch.testing.assert_close(cpu_native.gemm(x, cpu_native.pack_weight(w), 21), expected(x, w, None),
                               rtol=1e-5, atol=1e-5)


def test_gemm_refuses_a_packed_weight_of_another_shape():
    w = cpu_native.pack_weight(torch.randn(20, 8))
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.gemm(torch.randn(2, 9), w, 20)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.gemm(torch.randn(2, 8), w, 40)


@pytest.mark.parametrize("m", [1, 8, 9, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["native", "onednn", "torch"])
def test_plan_matches_float64_on_every_path(m, with_bias, path, monkeypatch):
    """Whatever path a plan takes (the native GEMM; oneDNN without the native kernels;
    plain torch with PDSERVE_CPU_LINEAR=torch), the product is right."""
    if path == "onednn":
        monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")  # the switch that turns the native kernels off
    elif path == "torch":
        monkeypatch.setenv("PDSERVE_CPU_LINEAR", "torch")
    x, w = torch.randn(m, 96), torch.randn(70, 96)
    b = torch.randn(70) if with_bias else None
    plan = kernels.LinearPlan(w, b)
    assert plan.native == (path == "native")
    assert (plan.packed is not None) == (path == "native")
    torch.testing.assert_close(plan(x), expected(x, w, b), rtol=1e-4, atol=1e-4)


def test_plan_takes_other_dtypes_through_torch():
    w = torch.randn(6, 4, dtype=torch.float64)
    plan = kernels.LinearPlan(w)
    assert not plan.native and plan.packed is None
    x = torch.randn(3, 4, dtype=torch.float64)
    torch.testing.assert_close(plan(x), F.linear(x, w))


def test_layer_repacks_after_weight_written():
    """A weight loaded or edited after the first forward must not leave a stale packed copy."""
    layer = Linear(24, 10, bias=True)
    x = torch.randn(20, 24)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), expected(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)
        layer.weight.copy_(torch.randn(10, 24))
        torch.testing.assert_close(layer(x), expected(x, layer.weight, layer.bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [1, 5, 300])  # 300 x 3 x 40 is over the threshold where two threads split the tokens
def test_store_kv_matches_the_reference(threads, n):
    """K and V rows (views into a fused projection, as the model hands them) land where the
    reference puts them in the head-major CPU cache; slot -1 is skipped."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(n)
        qkv = torch.randn(n, 7 * 40, generator=g)  # q 1 head, k 3, v 3: k/v are strided views
        key, value = qkv[:, 40:160].view(n, 3, 40), qkv[:, 160:].view(n, 3, 40)
        slots = torch.randperm(40 * 8, generator=g)[:n]
        if n > 1:
            slots[0] = -1
        got = kv_cache_tensor((2, 1, 40, 8, 3, 40), torch.float32, "cpu")
        want = torch.zeros(2, 1, 40, 8, 3, 40)
        cpu_native.store_kv(key, value, got[0, 0], got[1, 0], slots)
        reference.store_kv(key, value, want[0, 0], want[1, 0], slots)
        assert torch.equal(got, want) and got.any()
    finally:
        torch.set_num_threads(before)


def test_store_kv_refuses_a_slot_past_the_cache_and_writes_nothing():
    cache = kv_cache_tensor((2, 1, 4, 8, 1, 16), torch.float32, "cpu")
    with pytest.raises(ValueError, match="past the cache"):
        cpu_native.store_kv(torch.ones(2, 1, 16), torch.ones(2, 1, 16), cache[0, 0], cache[1, 0],
                            torch.tensor([3, 32]))
    assert not cache.any()


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


@pytest.mark.parametrize("threads", [1, 2])
# rows under, at and past the register tile and the 96-row block; k under, in and past
# the two-halves split of the 192-long slice; inter of one and of many panels
@pytest.mark.parametrize("m", [1, 4, 5, 7, 8, 9, 97, 200])
@pytest.mark.parametrize("k,inter", [(64, 16), (300, 48), (512, 1536), (1100, 32)])
def test_gemm_silu_is_silu_mul_of_gemm_bit_for_bit(threads, m, k, inter):
    """The fused gate/up product and activation equals the two steps it replaces exactly
    (so a prefill and a decode of the same token agree), and float64's result closely."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(m * 7 + k + inter)
        x = torch.randn(m, k + 3, generator=g)[:, 2:2 + k]  # rows further apart than k
        w = torch.randn(2 * inter, k, generator=g) / k ** 0.5
        packed = cpu_native.pack_weight(w)
        got = cpu_native.gemm_silu(x, packed, inter)
        assert torch.equal(got, cpu_native.silu_mul(cpu_native.gemm(x, packed, 2 * inter)))
        gate, up = expected(x, w, None).double().chunk(2, dim=-1)
        torch.testing.assert_close(got, (F.silu(gate) * up).float(), rtol=1e-4, atol=1e-4)
        plan = kernels.LinearPlan(w)
        assert torch.equal(plan.silu_mul(x), got)
    finally:
        torch.set_num_threads(before)


def test_gemm_silu_refuses_what_it_does_not_fit_and_the_plan_falls_back():
    w = torch.randn(2 * 24, 8)  # halves of 24 columns: not whole 16-column panels
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.gemm_silu(torch.randn(2, 8), cpu_native.pack_weight(w), 24)
    with pytest.raises(ValueError, match="does not fit"):
        cpu_native.gemm_silu(torch.randn(2, 9), cpu_native.pack_weight(torch.randn(32, 8)), 16)
    x = torch.randn(3, 8)
    gate, up = expected(x, w, None).chunk(2, dim=-1)
    torch.testing.assert_close(kernels.LinearPlan(w).silu_mul(x), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_elementwise_refuses_bad_shapes():
    with pytest.raises(cpu_native.NativeKernelError):
        cpu_native.silu_mul(torch.randn(2, 0))


def rope_tables(rows: int, head_dim: int):
    rope = RotaryEmbedding(1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim)), 512)
    positions = torch.randint(0, 512, (rows,))
    return rope.tables(positions, torch.float32)  # each [rows, 1, D]


@pytest.mark.parametrize("rows", [1, 5, 90])  # 90 rows of 12 heads: two threads split them
@pytest.mark.parametrize("normed", [False, True])
def test_qk_norm_rope_matches_torch_path(rows, normed):
    """In place on the fused projection: q and k heads as the torch path computes them
    (rms_norm * weight, then x * cos + roll(x) * sin), v untouched. Without the norm the
    rotation is the torch ops' own rounding, bit for bit (no fused multiply-add)."""
    hq, hkv, d = 8, 4, 64
    qkv = torch.randn(rows, (hq + 2 * hkv) * d) * 3
    q_norm, k_norm = (torch.rand(d) + 0.5, torch.rand(d) + 0.5) if normed else (None, None)
    cos, sin = rope_tables(rows, d)
    qk = qkv[:, :(hq + hkv) * d].view(rows, hq + hkv, d)
    if normed:
        weight = torch.cat((q_norm.expand(hq, -1), k_norm.expand(hkv, -1)))
        qk = F.rms_norm(qk, (d,), None, 1e-6) * weight
    want = RotaryEmbedding.apply(qk, (cos, sin)).reshape(rows, -1)
    v = qkv[:, (hq + hkv) * d:].clone()
    assert kernels.qk_norm_rope_(qkv, hq, hkv, d, q_norm, k_norm, 1e-6, cos.squeeze(1), sin.squeeze(1))
    got = qkv[:, :(hq + hkv) * d]
    if normed:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:
        assert torch.equal(got, want)
    assert torch.equal(qkv[:, (hq + hkv) * d:], v)


def test_qk_norm_rope_declines_what_it_does_not_take():
    cos, sin = rope_tables(2, 8)
    qkv = torch.randn(2, 32, dtype=torch.float64)
    before = qkv.clone()
    assert not kernels.qk_norm_rope_(qkv, 2, 1, 8, None, None, 1e-6, cos.squeeze(1), sin.squeeze(1))
    assert torch.equal(qkv, before)
    with pytest.raises(ValueError, match="cos and sin"):
        cpu_native.qk_norm_rope_(torch.randn(3, 32), 2, 1, 8, None, None, 1e-6, cos.squeeze(1), sin.squeeze(1))


def test_silu_mul_of_a_very_negative_gate_is_zero_not_nan():
    """exp(-g) overflows to inf past g ~ -88.7; the fused kernel must still give ~0 there,
    as torch's silu does (it gave NaN: -ffast-math's refined reciprocal of inf)."""
    gate = torch.tensor([-1000.0, -200.0, -95.0, -89.0, -88.0, -50.0, 0.0, 3.0] * 2)
    gate_up = torch.cat((gate, torch.full((16,), 2.0)))[None]
    got = cpu_native.silu_mul(gate_up)
    assert not got.isnan().any()
    torch.testing.assert_close(got, F.silu(gate)[None] * 2.0, rtol=1e-6, atol=1e-30)
