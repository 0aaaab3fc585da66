"""kernels.huge_pages: the buffers the decode step streams (packed weights, the KV cache)
on transparent huge pages. What callers rely on: the shape, dtype and contents they asked
for, memory that stays valid as long as the tensor, and plain torch tensors where the
buffer is too small to take a huge page."""
from __future__ import annotations

import gc
import mmap

import pytest
import torch

from pdserve.kernels import huge_pages


@pytest.mark.parametrize("shape", [(3, 5), (2, 1 << 19), (4, 3, 1 << 17)])  # under, at and over 2 MB
def test_zeros_are_zero_and_writable(shape):
    t = huge_pages.zeros(shape, torch.float32)
    assert t.shape == shape and t.dtype == torch.float32 and t.is_contiguous()
    assert not t.any()
    t.fill_(2.5)
    gc.collect()  # the mapping must outlive any local reference but the tensor's own
    assert float(t.sum()) == 2.5 * t.numel()


def test_large_buffers_are_mapped_and_small_ones_are_not():
    small = huge_pages.empty((16,), torch.float32)
    large = huge_pages.empty((huge_pages.HUGE_PAGE // 4,), torch.float32)
    assert large.data_ptr() % mmap.PAGESIZE == 0  # a fresh mapping, page-aligned
    assert small.untyped_storage().nbytes() == 64
    large[-1] = 1.0
    assert large[-1].item() == 1.0


def test_other_dtypes():
    t = huge_pages.zeros((1 << 20, 2), torch.bfloat16)
    assert t.dtype == torch.bfloat16 and not t.any()
