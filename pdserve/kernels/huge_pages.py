"""Host tensors on transparent huge pages, where the kernel grants them.

A decode step streams the packed weights and the paged KV cache from memory: hundreds of
MB per step in 4 KB pages, a TLB miss every few KB, and the hardware prefetcher stops at
every page edge. 2 MB pages take both away: a stream runs on for 512 times as far before
either happens. Linux hands out huge pages to anonymous memory marked MADV_HUGEPAGE when
/sys/kernel/mm/transparent_hugepage/enabled says `always` or `madvise`; with `never`,
or on another OS, the memory is ordinary and nothing else changes.

Only buffers of at least one huge page take this path (the mapping is page-granular and
torch's allocator serves smaller ones better); the mapping lives as long as the tensor.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A fresh anonymous mapping (it reads as zeros) marked for huge pages, viewed as a
    tensor; None where the buffer is under one huge page or the OS has no THP advice."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        buf.madvise(mmap.MADV_HUGEPAGE)
    except OSError:
        pass  # THP not built into this kernel: ordinary pages
    # the tensor holds a reference to `buf`: the mapping lives as long as the tensor
    return torch.frombuffer(buf, dtype=dtype, count=count).view(shape)


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CPU tensor, on huge pages where the kernel allows."""
    t = _mapped(shape, dtype)
    return torch.empty(shape, dtype=dtype) if t is None else t


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor, on huge pages where the kernel allows, its memory faulted in
    now: a huge page's first touch costs ~1-2 ms (the kernel zeroes, and at first may
    compact, 2 MB), which would otherwise land in the middle of a step. As torch.zeros
    does with ordinary pages, by writing them."""
    t = _mapped(shape, dtype)
    if t is None:
        return torch.zeros(shape, dtype=dtype)
    t.view(-1).view(torch.uint8)[::mmap.PAGESIZE].zero_()  # one write per page faults it in
    return t
