"""The int8 dot products by VNNI's vpdpbusd (kernels/csrc/qdot_cpu.c, "VNNI";
qdot_avxvnni_cpu.c, qdot_avx512vnni_cpu.c): built into every library (gcc 11 or later),
chosen only where the CPU reports the feature, and the same bits as AVX2's maddubs --
run on VNNI chips, and everywhere through the AVX-VNNI copy built with vpdpbusd's sum
emulated in AVX2 instructions (-DPD_QDOT_EMULATE_VNNI): the same code but that one
instruction, whose sum is exact."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pdserve.kernels import cpu_native, quant

from tests.kernels.test_cpu_quant_gemm import KINDS, random_weight
from tests.support.paged_utils import with_threads

CSRC = Path(cpu_native.__file__).with_name("csrc")
QDOT_SOURCES = ("qdot_cpu.c", "qdot_avxvnni_cpu.c", "qdot_avx512vnni_cpu.c", "elementwise_cpu.c")


def cpu_flags() -> set[str]:
    return {f for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")
            for f in ln.split(":", 1)[1].split()}


def vnni_bits() -> int:
    """pd_qdot_variants' bits as /proc/cpuinfo tells them (maddubs always)."""
    flags = cpu_flags()
    return 1 | ("avx_vnni" in flags) << 1 | ({"avx512_vnni", "avx512vl"} <= flags) << 2


@pytest.fixture(scope="module")
def lib():
    lib = cpu_native.library()
    assert lib is not None, "the native kernels did not build (is a C compiler installed?)"
    return lib


def declare(lib: ctypes.CDLL, *suffixes: str) -> None:
    """pd_gemm_qdot's and pd_gemm_silu_qdot's argument types on these copies of them."""
    base = cpu_native.library()
    for suffix in suffixes:
        for name in ("pd_gemm_qdot", "pd_gemm_silu_qdot"):
            fn, like = getattr(lib, name + suffix), getattr(base, name.replace("qdot", "q"))
            fn.restype, fn.argtypes = like.restype, like.argtypes
    for name in ("pd_qdot_variants", "pd_qdot_variant", "pd_qdot_set_variant"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] if name.endswith("set_variant") else []


def products(lib: ctypes.CDLL, suffix: str, w: quant.QuantWeight, x: torch.Tensor, threads: int
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x @ w^T + bias, silu(gate) * up of w as [gate; up] where w.n allows) by this copy."""
    m, k = x.shape
    bias = torch.linspace(-1, 1, w.n)
    y = torch.empty(m, w.n)
    gemm = getattr(lib, "pd_gemm_qdot" + suffix)
    assert with_threads(threads, lambda: gemm(x.data_ptr(), k, m, k, w.data.data_ptr(), w.code, bias.data_ptr(),
                                              y.data_ptr(), w.n, w.n, threads)) == 0
    if w.n % (2 * cpu_native.PANEL):
        return y, None
    act = torch.empty(m, w.n // 2)
    silu = getattr(lib, "pd_gemm_silu_qdot" + suffix)
    assert with_threads(threads, lambda: silu(x.data_ptr(), k, m, k, w.data.data_ptr(), w.code, act.data_ptr(),
                                              w.n // 2, w.n // 2, threads)) == 0
    return y, act


def cases():
    """Every kind; rows through each pass shape (1: two panels a row; 2-4: two panels; past 4:
    the row tiles, a partial one); panel counts odd and even; x with its group maxima and
    sign mixes (codes +-127), w with every code (q8_0: -128 too)."""
    for kind in KINDS:
        for n, k in ((48, 96), (64, 1024), (96, 64)):
            w = random_weight(kind, n, k, seed=n + k)
            for m in (1, 2, 3, 4, 5, 9, 17, 64):
                g = torch.Generator().manual_seed(m * 7 + k)
                x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
                x[:, ::31] *= 50  # a few values set their groups' scales
                yield kind, w, x


def assert_same_bits(lib: ctypes.CDLL, a: str, b: str) -> int:
    checked = 0
    for kind, w, x in cases():
        for threads in (1, 2):
            (ya, sa), (yb, sb) = products(lib, a, w, x, threads), products(lib, b, w, x, threads)
            assert torch.equal(ya, yb), (kind, tuple(x.shape), w.n, threads)
            assert (sa is None) == (sb is None) and (sa is None or torch.equal(sa, sb)), (kind, tuple(x.shape))
            checked += 1
    return checked


def test_the_vnni_copies_are_built_and_run_only_where_the_cpu_reports_vnni(lib):
    declare(lib, "_maddubs", "_avxvnni", "_avx512vnni")  # the symbols are there: the copies compiled
    assert lib.pd_qdot_variants() == vnni_bits()
    assert lib.pd_qdot_variant() == cpu_native.qdot_variant_for(vnni_bits())
    for variant in (1, 2):
        if not vnni_bits() >> variant & 1:  # never an instruction the CPU lacks, whatever is asked
            before = lib.pd_qdot_variant()
            assert lib.pd_qdot_set_variant(variant) == 1 and lib.pd_qdot_variant() == before
    assert lib.pd_qdot_set_variant(3) == 1 and lib.pd_qdot_set_variant(-1) == 1


def test_the_variant_policy(monkeypatch):
    for var in ("PDSERVE_CPU_VNNI", "PDSERVE_EMULATE_AVX2", "PDSERVE_KERNEL_CFLAGS"):
        monkeypatch.delenv(var, raising=False)
    pick = cpu_native.qdot_variant_for
    assert (pick(0b001), pick(0b011), pick(0b101), pick(0b111)) == (0, 1, 2, 1)
    monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-O2 -mno-avx512f")  # an AVX2 build: no AVX-512 code
    assert (pick(0b101), pick(0b111)) == (0, 1)
    monkeypatch.delenv("PDSERVE_KERNEL_CFLAGS")
    for var in ("PDSERVE_CPU_VNNI", "PDSERVE_EMULATE_AVX2"):
        monkeypatch.setenv(var, "0" if var == "PDSERVE_CPU_VNNI" else "1")
        assert pick(0b111) == 0
        monkeypatch.delenv(var)


def test_the_vnni_code_with_vpdpbusd_emulated_gives_the_maddubs_bits(tmp_path, lib):
    """Built as the library is (its flags, link without -ffast-math) with the AVX-VNNI copy's
    vpdpbusd emulated: that copy, selected and called directly, gives the maddubs copy's bits
    at every kind and row shape, 1 and 2 threads, and maddubs the loaded library's."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    objs = []
    for src in QDOT_SOURCES:
        obj = tmp_path / f"{src}.o"
        res = subprocess.run([cc, *cpu_native.FLAGS, "-DPD_QDOT_EMULATE_VNNI", "-c", "-o", str(obj), str(CSRC / src)],
                             capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        objs.append(str(obj))
    res = subprocess.run([cc, *cpu_native.LINK_FLAGS, "-o", str(tmp_path / "q.so"), *objs, "-lm"], capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    emulated = ctypes.CDLL(str(tmp_path / "q.so"))
    declare(emulated, "", "_maddubs", "_avxvnni")
    assert emulated.pd_qdot_variants() & 0b10  # the emulated copy runs here
    assert emulated.pd_qdot_set_variant(1) == 0 and emulated.pd_qdot_variant() == 1
    assert assert_same_bits(emulated, "_avxvnni", "_maddubs") == 2 * 3 * 3 * 8
    assert assert_same_bits(emulated, "", "_maddubs")  # the dispatcher on variant 1
    declare(lib, "_maddubs")
    for _, w, x in cases():
        assert torch.equal(products(emulated, "_maddubs", w, x, 1)[0], products(lib, "_maddubs", w, x, 1)[0])


@pytest.mark.skipif(vnni_bits() == 1, reason="needs a CPU with AVX-VNNI or AVX512-VNNI (this one has neither)")
def test_vnni_gives_the_maddubs_bits(lib):
    """On a VNNI chip: each copy the CPU runs, through the dispatcher and directly, gives
    maddubs' bits (the same integers, the same float steps)."""
    declare(lib, "", "_maddubs", "_avxvnni", "_avx512vnni")
    before = lib.pd_qdot_variant()
    try:
        for variant, suffix in ((1, "_avxvnni"), (2, "_avx512vnni")):
            if vnni_bits() >> variant & 1:
                assert lib.pd_qdot_set_variant(variant) == 0
                assert assert_same_bits(lib, suffix, "_maddubs") and assert_same_bits(lib, "", "_maddubs")
    finally:
        lib.pd_qdot_set_variant(before)


@pytest.mark.parametrize("name", ["qdot_avxvnni_cpu.c", "qdot_avx512vnni_cpu.c"])
def test_the_vnni_copies_compile_for_any_x86_target(tmp_path, name):
    """Under -Werror, for AVX2 and AVX-512 builds and a plain x86-64 one (where they are empty)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    for march in ("x86-64", "x86-64-v3", "x86-64-v4"):
        res = subprocess.run([cc, "-O3", f"-march={march}", "-ffast-math", "-fopenmp", "-fPIC", "-Wall", "-Werror",
                              "-c", "-o", str(tmp_path / "v.o"), str(CSRC / name)], capture_output=True, text=True,
                             timeout=300)
        assert res.returncode == 0, (march, res.stderr)
