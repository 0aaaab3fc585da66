"""Weight-only int8 / int4 GEMM (kernels/csrc/gemm_quant_cpu.c, kernels/quant.py): the
packing, GGUF's blocks repacked as they are, and the product -- bit for bit the float32
GEMM's on the dequantized weight, and near a float64 product."""
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

import kernels
from kernels import cpu_native, quant

from ._paged_utils import with_threads

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


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("kind", KINDS)
# rows: decode batches under and past the 6-row tile, past the 96-row block; n with panel
# tails; k in one slice, two halves that split a group (352 / 2 = 176), 192-wide slices
@pytest.mark.parametrize("m", [1, 2, 6, 7, 100])
@pytest.mark.parametrize("n,k", [(9, 32), (50, 352), (70, 576), (33, 1536)])
def test_quant_gemm_is_the_float32_gemm_of_the_dequantized_weight_bit_for_bit(threads, kind, m, n, k):
    w = random_weight(kind, n, k, m + n + k)
    x, b = torch.randn(m, k), torch.randn(n)
    dense = quant.dequantize(w)
    got = with_threads(threads, lambda: cpu_native.gemm_q(x, w, b))
    want = with_threads(threads, lambda: cpu_native.gemm(x, cpu_native.pack_weight(dense), n, b))
    assert torch.equal(got, want)
    ref = F.linear(x.double(), dense.double(), b.double()).float()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("m", [1, 9])
def test_quant_gemm_silu_and_plan(kind, m):
    w = random_weight(kind, 2 * 48, 128, m)
    x = torch.randn(m, 128)
    act = cpu_native.gemm_silu_q(x, w)
    assert torch.equal(act, cpu_native.silu_mul(cpu_native.gemm_q(x, w)))
    plan = kernels.LinearPlan(torch.empty(96, 128), None, w)
    assert plan.native and plan.kind == quant.KIND_CODES[kind] and plan.packed is w.data
    assert torch.equal(plan(x), cpu_native.gemm_q(x, w)) and torch.equal(plan.silu_mul(x), act)


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
    """Built for a CPU without AVX2 / F16C, the plain C tile reads the same layout (its
    sums in another order: near, not equal)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    csrc = Path(cpu_native.__file__).with_name("csrc")
    lib = tmp_path / "plain.so"
    res = subprocess.run([cc, "-O2", "-march=x86-64", "-fopenmp", "-fPIC", "-shared", "-o", str(lib),
                          *(str(csrc / f) for f in ("gemm_cpu.c", "gemm_quant_cpu.c", "elementwise_cpu.c")), "-lm"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    plain = ctypes.CDLL(str(lib))
    fn = plain.pd_gemm_q
    fn.restype, fn.argtypes = cpu_native.library().pd_gemm_q.restype, cpu_native.library().pd_gemm_q.argtypes
    for kind in KINDS:
        w, x = random_weight(kind, 40, 96, 5), torch.randn(3, 96)
        y = torch.empty(3, 40)
        assert fn(x.data_ptr(), 96, 3, 96, w.data.data_ptr(), w.code, 0, y.data_ptr(), 40, 40, 1) == 0
        torch.testing.assert_close(y, cpu_native.gemm_q(x, w), rtol=1e-5, atol=1e-5)


def test_avx512_build_compiles(tmp_path):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(cpu_native.__file__).with_name("csrc") / "gemm_quant_cpu.c"
    res = subprocess.run([cc, "-O3", "-march=x86-64-v4", "-ffast-math", "-fPIC", "-Werror", "-c", "-o",
                          str(tmp_path / "q.o"), str(src)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
