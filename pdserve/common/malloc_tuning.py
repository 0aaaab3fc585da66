"""Process allocator settings for CPU inference (glibc only).

glibc serves every allocation above its mmap threshold (128 KiB at start) with a fresh
mmap and returns it with munmap on free, and trims the heap top on free. A forward pass
allocates and frees activations of several MiB per op, so each one page-faults its
memory in again, a sizeable share of a CPU prefill step. Raising the mmap
threshold to 32 MiB (glibc's maximum) and the trim threshold to 1 GiB keeps freed
activation memory in the heap for the next op. The price is that the process keeps its
peak heap instead of returning it to the OS. `PDSERVE_MALLOC_TUNING=0` turns it off.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc refuses more (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 1 << 30

_applied = False


def keep_freed_memory() -> bool:
    """Apply the settings once per process; True when they are in effect."""
    global _applied
    if _applied:
        return True
    if os.environ.get("PDSERVE_MALLOC_TUNING", "1").strip() in ("0", "false", "no"):
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError) as e:
        log.debug("mallopt unavailable: %s", e)
        return False
    _applied = ok
    return ok
