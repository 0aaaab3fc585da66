"""The native GEMM on bf16 packed weights (kernels/csrc/gemm_cpu.c: pd_gemm_bf16,
pd_gemm_silu_bf16): each bf16 weight widened to float32 in registers, float32 activations
in and out. Against a float64 product of the bf16-rounded weight (the tolerance is float32
accumulation's), and bit for bit against the float32 GEMM on the widened weight."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import kernels
from pdserve.kernels import cpu_native

from tests.support.paged_utils import with_threads


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


def expected(x, w_bf16, b):
    return F.linear(x.double(), w_bf16.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("threads", [1, 2])
# rows: each of 1-8 (decode batches, under and past the 6- and 8-row tiles), then past the
# 96-row block (prefill chunks); columns and k odd, under and past a panel and a k slice
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 97, 300])
@pytest.mark.parametrize("n,k", [(9, 3), (33, 64), (130, 77), (40, 1100), (576, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_gemm_vs_float64(threads, m, n, k, with_bias):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if with_bias else None
    packed = cpu_native.pack_weight(w)
    assert packed.dtype == torch.bfloat16
    got = with_threads(threads, lambda: cpu_native.gemm(x, packed, n, b))
    torch.testing.assert_close(got, expected(x, w, b), rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 7, 200])
@pytest.mark.parametrize("k", [77, 300, 1100])
@pytest.mark.parametrize("n", [70, 90])  # an odd panel count, and a last pair of panels the second one partial
def test_bf16_gemm_is_the_float32_gemm_of_the_widened_weight_bit_for_bit(m, k, n):
    """Widening is exact and the sums run in pd_gemm's order: the same bits, so whatever
    holds of the float32 GEMM (a row independent of its batch, MKL's order) holds here --
    also where a decode step's rows take bf16 panels two at a time."""
    g = torch.Generator().manual_seed(k + m + n)
    x, w, b = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16), torch.randn(n)
    for threads in (1, 2):
        got = with_threads(threads, lambda: cpu_native.gemm(x, cpu_native.pack_weight(w), n, b))
        want = with_threads(threads, lambda: cpu_native.gemm(x, cpu_native.pack_weight(w.float()), n, b))
        assert torch.equal(got, want)


def test_pack_weight_narrows_to_nearest_even():
    w = torch.randn(37, 50)
    packed = cpu_native.pack_weight(w, torch.bfloat16)  # [3, 50, 16]
    assert packed.dtype == torch.bfloat16 and packed.shape == (3, 50, 16)
    unpacked = packed.transpose(1, 2).reshape(48, 50)[:37]
    assert torch.equal(unpacked, w.to(torch.bfloat16))  # torch's conversion rounds to nearest even
    with pytest.raises(ValueError, match="dtype"):
        cpu_native.pack_weight(w, torch.float16)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 3, 8, 100])
@pytest.mark.parametrize("k,inter", [(64, 16), (576, 1536), (200, 48)])
def test_bf16_gemm_silu(threads, m, k, inter):
    g = torch.Generator().manual_seed(m + k + inter)
    x = torch.randn(m, k, generator=g)
    w = (torch.randn(2 * inter, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    packed = cpu_native.pack_weight(w)
    got = with_threads(threads, lambda: cpu_native.gemm_silu(x, packed, inter))
    assert torch.equal(got, with_threads(threads, lambda: cpu_native.silu_mul(cpu_native.gemm(x, packed, 2 * inter))))
    gate_up = expected(x, w, None).double()
    want = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).float()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * k ** 0.5)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_plan_of_a_bf16_weight_takes_float32_activations(path, monkeypatch):
    """A bf16 linear on the CPU computes in float32 from the bf16 weight: natively from its
    bf16 panels, else through F.linear on the weight widened (same product up to order)."""
    if path == "torch":
        monkeypatch.setenv("PDSERVE_CPU_LINEAR", "torch")
    x, w, b = torch.randn(5, 96), torch.randn(70, 96).to(torch.bfloat16), torch.randn(70)
    plan = kernels.LinearPlan(w, b)
    assert plan.native == (path == "native")
    if plan.native:
        assert plan.packed.dtype == torch.bfloat16
    y = plan(x)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, expected(x, w, b), rtol=1e-4, atol=1e-4)
    wg = torch.randn(64, 96).to(torch.bfloat16)
    gu = kernels.LinearPlan(wg).silu_mul(x)
    ref = expected(x, wg, None)
    torch.testing.assert_close(gu, F.silu(ref[:, :32]) * ref[:, 32:], rtol=1e-4, atol=1e-4)


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("name", ["gemm_cpu.c", "gemm_tile_cpu.c"])
def test_avx512_bf16_build_compiles(tmp_path, name):
    """The AVX-512 tiles and the GEMM over them (and the AVX512_BF16 target) compile on any
    x86 machine with gcc, even where they cannot run."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(cpu_native.__file__).with_name("csrc") / name
    res = subprocess.run([cc, "-O3", "-march=x86-64-v3", "-mavx512f", "-mavx512bf16", "-ffast-math", "-fopenmp",
                          "-fPIC", "-Werror", "-c", "-o", str(tmp_path / "g.o"), str(src)],
                         capture_output=True, text=True, timeout=300)
    if res.returncode and "unrecognized" in res.stderr:
        pytest.skip(f"this compiler has no AVX512_BF16 target: {res.stderr.strip()}")
    assert res.returncode == 0, res.stderr


@pytest.mark.skipif("avx512f" not in _cpu_flags(), reason="needs a CPU with AVX-512 (this one has none)")
def test_avx512_build_gives_the_avx2_builds_bits(tmp_path, monkeypatch):
    """On an AVX-512 CPU the library runs the 8x32 zmm tiles; built with -mno-avx512f it runs
    the AVX2 tiles: both widen bf16 exactly and chain the same fused multiply-adds."""
    monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-mno-avx512f")
    avx2 = ctypes.CDLL(str(cpu_native.build(tmp_path)))
    fn = avx2.pd_gemm_bf16
    fn.restype, fn.argtypes = cpu_native.library().pd_gemm.restype, cpu_native.library().pd_gemm.argtypes
    for m, n, k in [(1, 70, 576), (8, 130, 77), (100, 33, 1100)]:
        x, w = torch.randn(m, k), torch.randn(n, k).to(torch.bfloat16)
        packed = cpu_native.pack_weight(w)
        y = torch.empty(m, n)
        assert fn(x.data_ptr(), k, m, k, packed.data_ptr(), 0, y.data_ptr(), n, n, 1) == 0
        assert torch.equal(y, cpu_native.gemm(x, packed, n))


def test_bf16_dot_cpu_follows_the_cpus_flags_and_the_overrides(monkeypatch):
    """Yes where /proc/cpuinfo lists AMX tiles or AVX512_BF16 (as torch.cpu reports them),
    no under --emulate-avx2 or an AVX2 kernel build; PDSERVE_CPU_BF16_DOT decides first."""
    for var in ("PDSERVE_CPU_BF16_DOT", "PDSERVE_EMULATE_AVX2", "PDSERVE_KERNEL_CFLAGS"):
        monkeypatch.delenv(var, raising=False)
    assert kernels.bf16_dot_cpu() == bool({"amx_tile", "avx512_bf16"} & _cpu_flags())
    monkeypatch.setenv("PDSERVE_EMULATE_AVX2", "1")
    assert not kernels.bf16_dot_cpu()
    monkeypatch.delenv("PDSERVE_EMULATE_AVX2")
    monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-O2 -mno-avx512f")
    assert not kernels.bf16_dot_cpu()
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "1")
    assert kernels.bf16_dot_cpu()
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "0")
    monkeypatch.delenv("PDSERVE_KERNEL_CFLAGS")
    assert not kernels.bf16_dot_cpu()


@pytest.mark.parametrize("with_bias", [False, True])
def test_prompt_rows_take_torchs_bf16_matmul_where_the_cpu_has_bf16_dot_products(monkeypatch, with_bias):
    """With bf16 dot products (forced here, so the dispatch runs on every CPU): a chunk of
    BF16_DOT_ROWS rows or more is torch's bf16 product of the bf16-rounded rows, widened,
    plus the bias; fewer rows, and decode rows of any count, take the widened tile, the same
    bits as on a CPU without them; the fused SwiGLU follows the same rule."""
    torch.manual_seed(0)
    k, n = 96, 64
    w, b = torch.randn(n, k).to(torch.bfloat16), (torch.randn(n) if with_bias else None)
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "0")
    widened = kernels.LinearPlan(w, b)
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "1")
    plan = kernels.LinearPlan(w, b)
    assert plan.native and plan.packed.dtype == torch.bfloat16
    rows = kernels.BF16_DOT_ROWS
    chunk, short = torch.randn(rows + 5, k), torch.randn(rows - 1, k)
    want = F.linear(chunk.to(torch.bfloat16), w).float() + (0 if b is None else b)
    assert torch.equal(plan(chunk), want)
    # bf16-rounded inputs and output: within a few bf16 steps of the float64 product
    torch.testing.assert_close(plan(chunk), expected(chunk, w, b), rtol=2 ** -6, atol=2 ** -6 * k ** 0.5)
    assert torch.equal(plan(short), widened(short))
    with kernels.decode_rows():
        assert torch.equal(plan(chunk), widened(chunk))
    if b is None:
        assert torch.equal(plan.silu_mul(chunk), kernels.silu_mul(want))
        assert torch.equal(plan.silu_mul(short), widened.silu_mul(short))
