"""The native CPU decode attention (kernels/csrc, built with the system C compiler)
against the naive per-token loop, plus its build, dispatch and refusal paths."""
from __future__ import annotations

import logging

import subprocess
import sys

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_attention, cpu_native

from tests.support.paged_utils import make_paged, naive_decode


@pytest.fixture(scope="module", autouse=True)
def built():
    assert cpu_native.library() is not None, "the native kernel did not build (is a C compiler installed?)"


def run(q, k_cache, v_cache, bt, cl, scale):
    return cpu_native.paged_decode_attention(q, k_cache, v_cache, bt, cl, scale)


@pytest.mark.parametrize("threads", [1, 2])
# groups of 1, 2, 3 and 8 query heads (AVX-512 takes them two at a time, an odd one alone);
# head dims past one or two 16-lane registers, a multiple of 8 only, and neither
@pytest.mark.parametrize("hq,hkv,d", [(4, 2, 8), (3, 3, 16), (8, 1, 32), (8, 4, 64), (9, 3, 64), (6, 2, 128), (4, 1, 24),
                                      (2, 2, 20)])
@pytest.mark.parametrize("lens", [
    [7, 1, 30, 0, 5, 12, 3, 9, 16, 2, 21, 4, 11, 6, 8, 13, 1, 25, 10],  # many sequences: one item each
    [40, 0],  # few sequences: one item per kv head
])
def test_native_vs_naive(threads, hq, hkv, d, lens):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        k_cache, v_cache, bt, cl = make_paged(lens, 4, hkv, d, torch.float32, seed=len(lens) + d)
        q = torch.randn(len(lens), hq, d)
        out = run(q, k_cache, v_cache, bt, cl, d ** -0.5)
    finally:
        torch.set_num_threads(before)
    assert out.shape == q.shape and out.dtype == torch.float32
    assert torch.all(out[lens.index(0)] == 0), "an empty context must give zeros, not NaN"
    torch.testing.assert_close(out.double(), naive_decode(q, k_cache, v_cache, bt, cl, d ** -0.5),
                               atol=1e-5, rtol=1e-5)


def test_long_contexts_split_across_threads():
    # enough work for both threads (the kernel keeps tiny batches on one thread)
    lens = [300, 17, 129, 256, 1, 64, 200, 95, 33]
    k_cache, v_cache, bt, cl = make_paged(lens, 16, 2, 32, torch.float32, seed=3)
    q = torch.randn(len(lens), 4, 32)
    torch.testing.assert_close(run(q, k_cache, v_cache, bt, cl, 0.2).double(),
                               naive_decode(q, k_cache, v_cache, bt, cl, 0.2), atol=1e-5, rtol=1e-5)


def test_strided_cache_views():
    # a layer's K/V as views with padding between heads and between blocks
    lens = [9, 23, 4]
    hkv, d, bs = 2, 16, 8
    k_full, v_full, bt, cl = make_paged(lens, bs, hkv + 1, d + 0, torch.float32)
    k_cache, v_cache = k_full[:, :, 1:], v_full[:, :, :hkv]  # non-contiguous in heads
    assert not k_cache.is_contiguous()
    q = torch.randn(len(lens), 4, d)
    torch.testing.assert_close(run(q, k_cache, v_cache, bt, cl, 0.3).double(),
                               naive_decode(q, k_cache, v_cache, bt, cl, 0.3), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bad", ["block id past the cache", "missing block", "context past the table"])
def test_bad_tables_are_refused(bad):
    k_cache, v_cache, bt, cl = make_paged([5, 9], 4, 1, 8, torch.float32)
    if bad == "block id past the cache":
        bt[1, 0] = k_cache.shape[0]
    elif bad == "missing block":
        bt[1, 2] = -1
    else:
        cl[0] = bt.shape[1] * 4 + 1
    kc = k_cache.clone()
    with pytest.raises(cpu_native.NativeKernelError, match="bad arguments"):
        run(torch.randn(2, 2, 8), k_cache, v_cache, bt, cl, 1.0)
    assert torch.equal(kc, k_cache)


def test_dispatcher_picks_native_for_fp32_and_torch_otherwise(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_native, "paged_decode_attention", lambda *a: calls.append("native") or a[0])
    monkeypatch.setattr(cpu_attention, "paged_decode_attention", lambda *a: calls.append("torch") or a[0])
    for dtype in (torch.float32, torch.float16):
        k_cache, v_cache, bt, cl = make_paged([3], 4, 1, 8, dtype)
        kernels.paged_decode_attention(torch.randn(1, 2, 8).to(dtype), k_cache, v_cache, bt, cl, 0.5)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    k_cache, v_cache, bt, cl = make_paged([3], 4, 1, 8, torch.float32)
    kernels.paged_decode_attention(torch.randn(1, 2, 8), k_cache, v_cache, bt, cl, 0.5)
    assert calls == ["native", "torch", "torch"]


def test_build_is_cached_and_keyed(tmp_path):
    first = cpu_native.build(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert cpu_native.build(tmp_path) == first and first.stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir()] == [first.name], "no temp files left behind"


def test_extra_compiler_flags_reach_the_compiler_and_the_key(tmp_path, monkeypatch):
    default = cpu_native.build().name  # the session's own build: no flags added
    monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-DPD_UNUSED_MACRO=1 '-DPD_QUOTED=a b'")
    other = cpu_native.build(tmp_path)
    assert other.name != default and other.is_file(), "other flags, another build"
    monkeypatch.setenv("PDSERVE_KERNEL_CFLAGS", "-fno-such-flag-pdserve")
    with pytest.raises(RuntimeError, match="no-such-flag-pdserve"):
        cpu_native.build(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [other.name], "a failed build leaves nothing behind"


def test_failed_build_falls_back_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    cpu_native.library.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="pdserve.kernels.cpu_native"):
            assert cpu_native.library() is None
        assert "failed to build" in caplog.text
        k_cache, v_cache, bt, cl = make_paged([6, 2], 4, 1, 8, torch.float32)
        q = torch.randn(2, 2, 8)
        assert not cpu_native.supports(q, k_cache, v_cache)
        torch.testing.assert_close(kernels.paged_decode_attention(q, k_cache, v_cache, bt, cl, 0.5).double(),
                                   naive_decode(q, k_cache, v_cache, bt, cl, 0.5), atol=1e-5, rtol=1e-5)
    finally:
        monkeypatch.undo()
        cpu_native.library.cache_clear()
    assert cpu_native.library() is not None


def test_loading_the_kernel_keeps_subnormal_floats():
    """Linking with -ffast-math would pull in crtfastmath.o, which sets flush-to-zero for
    the whole process that loads the library (every worker, and the test process). The
    fresh process loads the library every worker loads: the cached default build."""
    cpu_native.build()  # built here (if no earlier test did): the child only loads it
    code = ("import sys, ctypes; from pdserve.kernels import cpu_native; "
            "ctypes.CDLL(str(cpu_native.build())); "
            "print(sys.float_info.min / 2 > 0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True", "loading the native kernel turned on flush-to-zero"
