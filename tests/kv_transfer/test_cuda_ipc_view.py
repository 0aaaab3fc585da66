"""cuda_ipc.view_from_storage, the part of the CUDA IPC backend that runs on CPU: the
exported (shape, stride, offset, dtype) rebuild the same view over an opened storage."""
from __future__ import annotations

import pytest
import torch

from pdserve.kv_transfer.cuda_ipc import view_from_storage


def _info(t: torch.Tensor) -> dict:
    """The view fields of export_handle (its CUDA handle fields are not needed here)."""
    return {"shape": list(t.shape), "stride": list(t.stride()), "storage_offset": t.storage_offset(),
            "dtype": str(t.dtype).removeprefix("torch.")}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_rebuilds_a_kv_cache_view(dtype):
    base = torch.randn(2, 3, 6, 4, 2, 5).to(dtype)  # [2, L, num_blocks, bs, H, D]
    t = base[:, :, 1:5]  # a non-contiguous view with a storage offset
    view = view_from_storage(base.untyped_storage(), _info(t))
    assert view.dtype == dtype and view.shape == t.shape and view.stride() == t.stride()
    assert view.storage_offset() == t.storage_offset() > 0
    assert torch.equal(view, t)
    view[0, 0, 0].fill_(7)  # shares memory with the exporter
    assert bool((base[0, 0, 1] == 7).all())


def test_explicit_shape_stride_offset():
    base = torch.arange(40, dtype=torch.float32)
    info = {"shape": [3, 4], "stride": [1, 3], "storage_offset": 5, "dtype": "float32"}
    view = view_from_storage(base.untyped_storage(), info)
    assert torch.equal(view, torch.as_strided(base, (3, 4), (1, 3), 5))
    assert view[2, 3].item() == 5 + 2 + 9


def test_unknown_dtype_is_refused():
    base = torch.zeros(4)
    with pytest.raises(ValueError, match="dtype"):
        view_from_storage(base.untyped_storage(), {"shape": [4], "stride": [1], "storage_offset": 0,
                                                   "dtype": "complex64"})


@pytest.mark.parametrize("shape, stride, offset", [
    ([10, 4], [4, 1], 1),  # one element past the end
    ([41], [1], 0),
    ([2, 2], [1000, 1], 0),  # a stride that jumps out
    ([4], [1], 10**12),
    ([4], [-1], 3),  # negative strides walk backwards out of it
    ([4], [1], -1),
    ([4, 4], [1], 0),  # stride rank differs
], ids=["offset", "size", "stride", "huge-offset", "negative-stride", "negative-offset", "rank"])
def test_out_of_bounds_views_are_refused(shape, stride, offset):
    """The peer's shape/stride/offset must address only the storage it shared."""
    base = torch.zeros(40, dtype=torch.float32)
    with pytest.raises(ValueError, match="CUDA IPC view"):
        view_from_storage(base.untyped_storage(), {"shape": shape, "stride": stride, "storage_offset": offset,
                                                   "dtype": "float32"})
    view = view_from_storage(base.untyped_storage(), {"shape": [10, 4], "stride": [4, 1], "storage_offset": 0,
                                                      "dtype": "float32"})
    assert view.shape == (10, 4)  # the exact fit is fine
