"""Weight-only int8 / int4 GEMM (kernels/csrc/gemm_quant_cpu.c, kernels/quant.py): the
packing, GGUF's blocks repacked as they are, and the product: by int8 dot products for a
decode batch (their integer math in float64, up to float32 rounding; near float32 on the
dequantized weight, within the activations' rounding; a row's the same in any batch), by
the float32 tile on dequantized slices for more rows, bit for bit the float32 GEMM's on
the dequantized weight."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.kernels import cpu_native, quant

from tests.support.paged_utils import with_threads

KINDS = tuple(quant.KIND_CODES)


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


def random_weight(kind: str, n: int, k: int, seed: int) -> quant.QuantWeight:
    """Random codes and scales of `kind` (q4_0 has no quantizer from float here)."""
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-128, 128) if kind == "q8_0" else (0, 16)
    q = torch.randint(lo, hi, (n, k), generator=g).to(torch.int8 if kind == "q8_0" else torch.uint8)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).to(torch.float16)
    m = (-torch.rand(n, k // 32, generator=g) * 0.1).to(torch.float16) if kind == "q4_1" else None
    return quant.pack(kind, q, d, m)


@pytest.mark.parametrize("kind", KINDS)
def test_pack_unpack_round_trip_and_layout(kind):
    w = random_weight(kind, 37, 96, 1)
    assert w.data.dtype == torch.uint8 and w.data.shape == (3, 3 * quant.block_bytes(kind))
    q, d, m = quant.unpack(w)
    again = quant.pack(kind, q, d, m)
    assert torch.equal(again.data, w.data)
    # the padded columns of the last panel hold zero weights
    padded = quant.QuantWeight(kind, 48, 96, w.data)
    assert torch.equal(quant.dequantize(padded)[37:], torch.zeros(11, 96))


@pytest.mark.parametrize("kind,bound", [("q8_0", 1 / 254), ("q4_1", 1 / 30)])
def test_quantize_from_float_error_is_half_a_step(kind, bound):
    w = torch.randn(64, 256)
    err = (quant.dequantize(quant.quantize(w, kind)) - w).abs().reshape(64, 8, 32)
    spread = w.abs().reshape(64, 8, 32).amax(-1, keepdim=True) * (2 if kind == "q4_1" else 1)
    assert bool((err <= spread * bound * 1.01 + 1e-6).all())


def test_quantize_refuses_k_outside_whole_groups():
    with pytest.raises(ValueError, match="groups of 32"):
        quant.quantize(torch.randn(16, 40), "q8_0")
    with pytest.raises(ValueError, match="not one of"):
        quant.quantize(torch.randn(16, 64), "q5_0")


def integer_reference(x: torch.Tensor, w: quant.QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The int8 dot products' arithmetic (qdot_cpu.c's header) in float64 on x's
    codes as the kernel quantizes them: exact but for the kernel's float32 roundings."""
    qx, dx, sx = quant.quantize_rows(x)
    q, d, m = quant.unpack(w)
    g = w.k // 32
    q = q.to(torch.int64) - (8 if w.kind == "q4_0" else 0)
    isum = torch.einsum("mgi,ngi->mng", qx.to(torch.int64).reshape(-1, g, 32), q.reshape(w.n, g, 32))
    y = (isum.double() * d.double().unsqueeze(0) * dx.double().unsqueeze(1)).sum(-1)
    if m is not None:
        y += (m.double().unsqueeze(0) * (dx.double() * sx.double()).unsqueeze(1)).sum(-1)
    return y if bias is None else y + bias.double()


def test_activation_quantization_is_round_to_nearest_per_32():
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e-3, 30.0]).unsqueeze(1)
    x[1, :32] = 0  # an all-zero group: scale 0, codes 0
    q, d, s = quant.quantize_rows(x)
    amax = x.reshape(3, 3, 32).abs().amax(-1)
    torch.testing.assert_close(d, amax / 127, rtol=2e-7, atol=0)
    scaled = x.reshape(3, 3, 32) / torch.where(d == 0, 1.0, d).unsqueeze(-1)
    assert bool(((q.reshape(3, 3, 32).float() - scaled).abs() <= 0.5 + 1e-4).all())
    assert int(q.abs().max()) == 127 and torch.equal(q[1, :32], torch.zeros(32, dtype=torch.int8))
    assert torch.equal(s, q.reshape(3, 3, 32).to(torch.int32).sum(-1))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
# rows: decode batches and prefill chunks (row tiles of 4 and their tails, past the 128-row
# block); n with panel tails
@pytest.mark.parametrize("m", [1, 3, 5, 8, 100, 131])
@pytest.mark.parametrize("n,k", [(9, 32), (50, 352), (70, 576), (33, 1536)])
def test_product_is_the_integer_dot_products(threads, kind, m, n, k):
    """The integer math to float32 rounding, and within the activations' int8 rounding
    (half a step of max |x| / 127 per value) of float32 on the dequantized weight."""
    w = random_weight(kind, n, k, m + n + k)
    x, b = torch.randn(m, k), torch.randn(n)
    got = with_threads(threads, lambda: quant.gemm_q(x, w, b, dequant=False))
    if m <= quant.QDOT_ROWS:  # what gemm_q chooses for a decode batch
        assert torch.equal(got, with_threads(threads, lambda: quant.gemm_q(x, w, b)))
    want = integer_reference(x, w, b)
    terms = x.abs().double() @ quant.dequantize(w).abs().double().T  # the sums' size
    assert bool(((got.double() - want).abs() <= 1e-6 * terms + 1e-6).all())
    dense = F.linear(x.double(), quant.dequantize(w).double(), b.double())
    step = x.abs().reshape(m, -1, 32).amax(-1).repeat_interleave(32, dim=1) / 127 / 2  # each value's rounding bound
    bound = step.double() @ quant.dequantize(w).abs().double().T
    assert bool(((got.double() - dense).abs() <= bound + 1e-5).all())


@pytest.mark.parametrize("kind", KINDS)
def test_a_rows_dot_products_do_not_depend_on_its_batch(kind):
    """By int8 dot products each row of a 200-row product (two 128-row blocks, on two
    threads) equals that row's product alone or among a decode batch of up to 4 rows (two
    panels per pass), on one thread or two, and the same for SwiGLU's fused pair."""
    w, x = random_weight(kind, 2 * 48, 96, 7), torch.randn(200, 96)
    whole = with_threads(2, lambda: quant.gemm_q(x, w, dequant=False))
    act = with_threads(2, lambda: quant.gemm_silu_q(x, w, dequant=False))
    for lo, hi in ((0, 1), (3, 4), (127, 128), (128, 129), (199, 200), (10, 12), (20, 23), (30, 34), (40, 45)):
        rows = x[lo:hi]
        for threads in (1, 2):
            assert torch.equal(whole[lo:hi], with_threads(threads, lambda r=rows: quant.gemm_q(r, w, dequant=False)))
            assert torch.equal(act[lo:hi], with_threads(threads, lambda r=rows: quant.gemm_silu_q(r, w, dequant=False)))


def test_integer_reference_catches_a_wrong_kernel():
    """The reference tells kinds apart (the bound above can fail): q4_0's offset matters."""
    w = random_weight("q4_0", 32, 64, 2)
    x = torch.randn(1, 64)
    q, d, _ = quant.unpack(w)
    no_offset = quant.pack("q4_1", q, d, torch.zeros_like(d))  # the same codes read without their offset
    assert not torch.allclose(quant.gemm_q(x, w, dequant=False).double(), integer_reference(x, no_offset), rtol=1e-3)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
# rows under and past the 6-row tile, past the 96-row block; n with panel tails; k in one
# slice, two halves that split a group (352 / 2 = 176), 192-wide slices
@pytest.mark.parametrize("m", [1, 7, 9, 100])
@pytest.mark.parametrize("n,k", [(9, 32), (50, 352), (70, 576), (33, 1536)])
def test_dequant_tile_is_the_float32_gemm_of_the_dequantized_weight_bit_for_bit(threads, kind, m, n, k):
    w = random_weight(kind, n, k, m + n + k)
    x, b = torch.randn(m, k), torch.randn(n)
    dense = quant.dequantize(w)
    got = with_threads(threads, lambda: quant.gemm_q(x, w, b, dequant=True))
    want = with_threads(threads, lambda: cpu_native.gemm(x, cpu_native.pack_weight(dense), n, b))
    assert torch.equal(got, want)
    if m > quant.QDOT_ROWS:  # what gemm_q chooses for a prefill chunk
        assert torch.equal(got, with_threads(threads, lambda: quant.gemm_q(x, w, b)))
    ref = F.linear(x.double(), dense.double(), b.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 9, 131])
def test_quant_gemm_silu_and_plan(kind, m):
    w = random_weight(kind, 2 * 48, 128, m)
    x = torch.randn(m, 128)
    act = quant.gemm_silu_q(x, w)
    assert torch.equal(act, cpu_native.silu_mul(quant.gemm_q(x, w)))
    for dequant in (False, True):
        assert torch.equal(quant.gemm_silu_q(x, w, dequant=dequant),
                           cpu_native.silu_mul(quant.gemm_q(x, w, dequant=dequant)))
    plan = kernels.LinearPlan(torch.empty(96, 128), None, w)
    assert plan.native and plan.kind == quant.KIND_CODES[kind] and plan.packed is w.data
    assert torch.equal(plan(x), quant.gemm_q(x, w)) and torch.equal(plan.silu_mul(x), act)


def test_plan_off_the_native_path_multiplies_the_dequantized_weight(monkeypatch):
    monkeypatch.setenv("PDSERVE_CPU_LINEAR", "torch")
    w = random_weight("q4_1", 40, 64, 3)
    x = torch.randn(3, 64)
    plan = kernels.LinearPlan(torch.empty(40, 64), None, w)
    assert not plan.native
    torch.testing.assert_close(plan(x), F.linear(x, quant.dequantize(w)))


@pytest.mark.parametrize("qtype", list(quant.GGUF_KINDS))
def test_gguf_blocks_repack_to_the_gguf_packages_dequantized_weights(qtype):
    """GGUF's own quantizer writes the blocks; our repack dequantizes to gguf-py's floats."""
    n, k = 45, 160
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    raw = gguf.quants.quantize(w, kind)
    ours = quant.from_gguf(qtype, raw, n, k)
    assert ours.kind == quant.GGUF_KINDS[qtype][0]
    assert torch.equal(quant.dequantize(ours), torch.from_numpy(gguf.quants.dequantize(raw, kind)))
    order = torch.randperm(n)
    assert torch.equal(quant.dequantize(quant.permute_rows(ours, order)), quant.dequantize(ours)[order])


def test_non_avx2_build_gives_the_same_values(tmp_path):
    """Built for a CPU without AVX2 / F16C, the plain C code reads the same layout: its
    integer dot products and dequantizing tile near the AVX2 build's."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    csrc = Path(cpu_native.__file__).with_name("csrc")
    lib = tmp_path / "plain.so"
    res = subprocess.run([cc, "-O2", "-march=x86-64", "-fopenmp", "-fPIC", "-shared", "-o", str(lib),
                          *(str(csrc / f) for f in ("gemm_cpu.c", "gemm_tile_cpu.c", "gemm_quant_cpu.c", "qdot_cpu.c",
                                                    "elementwise_cpu.c")),
                          "-lm"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    plain = ctypes.CDLL(str(lib))
    for dequant in (False, True):
        fn = plain.pd_gemm_q_dequant if dequant else plain.pd_gemm_qdot
        fn.restype, fn.argtypes = cpu_native.library().pd_gemm_q.restype, cpu_native.library().pd_gemm_q.argtypes
        for kind in KINDS:
            for m in (1, 9):  # one row: panels two at a time in the AVX2 build
                w, x = random_weight(kind, 40, 96, 5), torch.randn(m, 96)
                y = torch.empty(m, 40)
                assert fn(x.data_ptr(), 96, m, 96, w.data.data_ptr(), w.code, 0, y.data_ptr(), 40, 40, 1) == 0
                torch.testing.assert_close(y, quant.gemm_q(x, w, dequant=dequant), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["gemm_quant_cpu.c", "qdot_cpu.c"])
def test_avx512_build_compiles(tmp_path, name):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(cpu_native.__file__).with_name("csrc") / name
    res = subprocess.run([cc, "-O3", "-march=x86-64-v4", "-ffast-math", "-fPIC", "-Werror", "-c", "-o",
                          str(tmp_path / "q.o"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
