"""The memory-read bound a decode step is held to: a multi-threaded streaming read of a
buffer as large as the step's working set (its weights, and the KV it reads), measured in the
benchmark's own run, with the engine's thread count; beside it the chip's nominal bandwidth
where known, and whether the working set fits in the last-level cache (then the bound is that
cache's, not DRAM's).

The read is a C loop (compiled at first use with the native kernels' flags: -O3 -march=native
-fopenmp) in which each thread sums its contiguous slice of a float32 buffer into 32 independent
lanes -- the compiler turns them into vector adds with no dependency chain to wait on, so the
loop is bound by how fast the memory system delivers bytes, as a decode step's weight reads are.
torch.sum is not such a bound: it reduces in one accumulation order and pdserve's own
products outrun it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.facts import cpu_facts, last_level_cache_bytes

SOURCE = r"""
#include <omp.h>
#include <stddef.h>

/* Sum of buf[0..n) read by `threads` threads, each its contiguous slice, 32 lanes each. */
double pd_stream_read(const float *buf, size_t n, int threads) {
    double total = 0.0;
    #pragma omp parallel num_threads(threads) reduction(+:total)
    {
        size_t t = (size_t)omp_get_thread_num(), nt = (size_t)omp_get_num_threads();
        size_t lo = n * t / nt, hi = n * (t + 1) / nt, i = lo;
        float acc[32] = {0};
        for (; i + 32 <= hi; i += 32)
            for (int j = 0; j < 32; j++) acc[j] += buf[i + j];
        float s = 0.0f;
        for (int j = 0; j < 32; j++) s += acc[j];
        for (; i < hi; i++) s += buf[i];
        total += s;
    }
    return total;
}
"""
# no -ffast-math: linked into a .so it sets flush-to-zero for the whole process (crtfastmath.o);
# the 32 explicit lanes vectorize without it
FLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "pdserve" / "bench"
_lib: ctypes.CDLL | None = None


def _library() -> ctypes.CDLL:
    """The compiled read loop, built once per source, flags and CPU."""
    global _lib
    if _lib is not None:
        return _lib
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler {cc!r} on PATH (install gcc, or set CC)")
    key = hashlib.sha256((SOURCE + " ".join(FLAGS) + str(cpu_facts())).encode()).hexdigest()[:16]
    lib = CACHE / f"stream_read_{key}.so"
    if not lib.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            src = Path(tmp) / "stream_read.c"
            src.write_text(SOURCE)
            out = Path(tmp) / lib.name
            res = subprocess.run([cc, *FLAGS, "-o", str(out), str(src)], capture_output=True, text=True)
            if res.returncode != 0:
                raise RuntimeError(f"{cc} failed to build the streaming read:\n{res.stderr.strip()}")
            shutil.move(str(out), lib)
    _lib = ctypes.CDLL(str(lib))
    _lib.pd_stream_read.restype = ctypes.c_double
    _lib.pd_stream_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _lib


def stream_read_bandwidth(nbytes: int, threads: int, rounds: int = 5) -> float:
    """Bytes per second of the best of `rounds` streaming reads of a random float32 buffer of
    `nbytes` by `threads` threads (after one untimed read: pages faulted in, caches as warm as
    they get; random values: a fresh buffer's zero pages would all be one cached page)."""
    lib = _library()
    buf = np.random.default_rng(0).random(max(1, nbytes // 4), dtype=np.float32)
    ptr, n = buf.ctypes.data, buf.size
    lib.pd_stream_read(ptr, n, threads)
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        lib.pd_stream_read(ptr, n, threads)
        best = min(best, time.perf_counter() - t)
    return buf.nbytes / best


def bound_facts(working_set: int, threads: int, bandwidth_b_s: float, nominal_gb_s: float | None,
                nominal_source: str | None) -> dict:
    """What a bound rests on: the working set, the last-level cache, the read measured, the
    nominal figure -- and which memory the bound is really of."""
    llc = last_level_cache_bytes()
    fits = llc is not None and working_set <= llc
    return {"working_set_bytes": working_set, "threads": threads, "read_gb_s": bandwidth_b_s / 1e9,
            "method": "multi-threaded streaming read (benchmarks/harness/bandwidth.py) of a buffer of the working "
                      "set's size, best of its rounds",
            "llc_bytes": llc, "fits_in_llc": fits,
            "bound_of": "the last-level cache (the working set fits in it)" if fits else "DRAM (the working set "
                        "exceeds the last-level cache)",
            "nominal_gb_s": nominal_gb_s, "nominal_source": nominal_source or "not known for this chip"}
