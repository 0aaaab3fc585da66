"""kv_transfer.base: block-run coalescing, layout comparison, gather/scatter."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.engine.kv_layout import kv_cache_tensor, layout_mismatch
from pdserve.common.wire.messages import KVLayout
from pdserve.kv_transfer.base import copy_blocks, copy_blocks_indexed, gather_kv, runs, scatter_kv


@pytest.mark.parametrize("src, dst, want", [
    ([], [], []),
    ([4], [9], [(4, 9, 1)]),
    ([1, 2, 3], [5, 6, 7], [(1, 5, 3)]),
    ([1, 2, 4], [5, 6, 7], [(1, 5, 2), (4, 7, 1)]),  # src breaks
    ([1, 2, 3], [5, 7, 8], [(1, 5, 1), (2, 7, 2)]),  # dst breaks
    ([3, 2, 1], [7, 6, 5], [(1, 5, 3)]),  # copy order is free: descending pairs merge too
    ([0, 1, 7, 8, 9], [10, 11, 2, 3, 4], [(0, 10, 2), (7, 2, 3)]),
    ([5, 6, 0, 1], [3, 4, 8, 9], [(0, 8, 2), (5, 3, 2)]),
])
def test_runs_coalesces_consecutive_pairs(src, dst, want):
    assert runs(src, dst) == want


def _expand(out: list[tuple[int, int, int]]) -> list[tuple[int, int]]:
    return [(s + i, d + i) for s, d, n in out for i in range(n)]


@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=30))
def test_runs_copy_exactly_the_mapping(pairs):
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    out = runs(src, dst)
    assert sorted(_expand(out)) == sorted(pairs)  # every pair once, nothing else
    assert all(n >= 1 for _, _, n in out)


@given(st.permutations(list(range(12))))
def test_runs_of_a_shifted_block_range_is_one_copy(order):
    """Blocks [a, a+n) to [b, b+n), listed in any order: one copy."""
    src = [i + 3 for i in order]
    dst = [i + 20 for i in order]
    assert runs(src, dst) == [(3, 20, 12)]


LAYOUT = KVLayout(model_fingerprint="abc123", dtype="float32", block_size=16, num_layers=4, num_kv_heads=2,
                  head_dim=32)


def test_layout_mismatch_none_when_equal():
    assert layout_mismatch(LAYOUT, dataclasses.replace(LAYOUT)) is None


@pytest.mark.parametrize("field, other", [
    ("model_fingerprint", "ffff"), ("dtype", "bfloat16"), ("block_size", 32), ("num_layers", 2),
    ("num_kv_heads", 4), ("head_dim", 64),
])
def test_layout_mismatch_names_the_field_and_both_values(field, other):
    msg = layout_mismatch(LAYOUT, dataclasses.replace(LAYOUT, **{field: other}))
    assert msg == f"{field}: prefill has {getattr(LAYOUT, field)!r}, decode has {other!r}"


def test_layout_mismatch_lists_every_difference():
    msg = layout_mismatch(LAYOUT, dataclasses.replace(LAYOUT, block_size=32, head_dim=64))
    assert msg == "block_size: prefill has 16, decode has 32; head_dim: prefill has 32, decode has 64"


def _cache(num_blocks: int = 10, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn((2, 3, num_blocks, 4, 2, 5), generator=g)  # [2, L, N, bs, H, D]


def test_gather_then_scatter_moves_exactly_the_blocks():
    src, dst = _cache(seed=1), torch.zeros(2, 3, 12, 4, 2, 5)
    buf = gather_kv(src, [7, 1, 2])
    assert buf.shape == (2, 3, 3, 4, 2, 5) and buf.is_contiguous()
    scatter_kv(dst, [0, 10, 11], buf)
    for s, d in [(7, 0), (1, 10), (2, 11)]:
        assert torch.equal(dst[:, :, d], src[:, :, s])
    untouched = [b for b in range(12) if b not in (0, 10, 11)]
    assert not dst[:, :, untouched].any()


@pytest.mark.parametrize("layer", [None, 1])
def test_copy_blocks_one_layer_or_all(layer):
    src, dst = _cache(seed=2), torch.zeros(2, 3, 10, 4, 2, 5)
    copy_blocks(dst, src, [0, 1, 5], [3, 4, 9], layer)
    layers = range(3) if layer is None else [layer]
    for li in range(3):
        for s, d in [(0, 3), (1, 4), (5, 9)]:
            if li in layers:
                assert torch.equal(dst[:, li, d], src[:, li, s])
            else:
                assert not dst[:, li, d].any()


@pytest.mark.parametrize("layer", [None, 2])
def test_indexed_copy_equals_run_copy(layer):
    """The one-gather-one-scatter copy (taken on CUDA for scattered blocks) lands the same
    bytes as the run-by-run copy, and touches nothing else."""
    src = _cache(seed=3)
    mapping = [(5, 9), (0, 2), (7, 3), (1, 8), (2, 0)]  # no two consecutive: five runs
    s, d = [m[0] for m in mapping], [m[1] for m in mapping]
    by_runs, indexed = torch.zeros(2, 3, 10, 4, 2, 5), torch.zeros(2, 3, 10, 4, 2, 5)
    copy_blocks(by_runs, src, s, d, layer)
    copy_blocks_indexed(indexed, src, s, d, range(3) if layer is None else (layer,))
    assert torch.equal(indexed, by_runs) and indexed.any()


def test_cpu_cache_is_head_major_in_memory_and_moves_by_index():
    """The CPU cache is indexed [2, L, N, bs, H, D] but laid out head-major per block; a
    transfer to a token-major cache (the GPU's order) or back keeps every value in place."""
    shape = (2, 3, 6, 4, 2, 5)
    cpu = kv_cache_tensor(shape, torch.float32, "cpu")
    assert cpu.shape == shape and not cpu.any()
    assert cpu.stride()[3:] == (5, 20, 1)  # token stride D, head stride bs * D
    src = _cache(seed=4, num_blocks=6)
    cpu.copy_(src)
    token_major = torch.zeros(shape)
    scatter_kv(token_major, [5, 0], gather_kv(cpu, [1, 4]))
    assert torch.equal(token_major[:, :, 5], src[:, :, 1]) and torch.equal(token_major[:, :, 0], src[:, :, 4])
    back = kv_cache_tensor(shape, torch.float32, "cpu")
    copy_blocks(back, token_major, [5], [2])
    assert torch.equal(back[:, :, 2], src[:, :, 1]) and not back[:, :, [0, 1, 3, 4, 5]].any()
    flat = torch.zeros(cpu.numel())
    laid = kv_cache_tensor(shape, torch.float32, "cpu", storage=flat)
    laid.copy_(src)  # the storage form (shm) lays the same order into the given buffer
    assert torch.equal(flat.view(2, 3, 6, 2, 4, 5), src.transpose(3, 4))
