"""The hardware limits a run's figures are held against, measured in that run: a
streaming read of device memory (decode's bound) and a dense matrix product in the run's
dtype (prefill's bound; cuBLAS on a GPU)."""
from __future__ import annotations

import time
from collections.abc import Callable

import torch


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def best_seconds(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 2) -> float:
    """The fastest of `reps` timed calls of fn, after `warmup` untimed ones; each call
    synchronised with the device on both sides."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(reps):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def read_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> dict:
    """Bytes per second of a streaming read: the sum of a float32 buffer of `nbytes` (far
    larger than the last-level cache), which reads each byte once and writes one number.
    A device-to-device copy is reported beside it, counting bytes read and written."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    read_s = best_seconds(lambda: buf.sum(), device, reps)
    dst = torch.empty_like(buf)
    copy_s = best_seconds(lambda: dst.copy_(buf), device, reps)
    return {"bytes": nbytes, "read_gb_per_s": nbytes / read_s / 1e9, "copy_gb_per_s": 2 * nbytes / copy_s / 1e9,
            "method": "best of %d: float32 sum (read); copy_ (read + write)" % reps}


def matmul_peak(device: torch.device, dtype: torch.dtype, size: int, reps: int = 10) -> dict:
    """FLOP/s of the best of `reps` products of two random [size, size] matrices in
    `dtype` by torch.matmul (cuBLAS on a GPU)."""
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, generator=g, device=device).to(dtype)
    b = torch.randn(size, size, generator=g, device=device).to(dtype)
    s = best_seconds(lambda: torch.matmul(a, b), device, reps)
    return {"size": size, "dtype": str(dtype).removeprefix("torch."), "tflops": 2 * size ** 3 / s / 1e12,
            "method": f"best of {reps}: torch.matmul of two random {size}x{size}"}
