"""common.engine.graph_runner bucketing: which padded batch sizes get a (CUDA-graph) decode
buffer, and which bucket serves a batch."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.common.engine.graph_runner import bucket_sizes, pick_bucket


@pytest.mark.parametrize("max_batch, want", [
    (1, [1]),
    (2, [1, 2]),
    (3, [1, 2, 3]),
    (4, [1, 2, 4]),
    (5, [1, 2, 4, 5]),
    (8, [1, 2, 4, 8]),
    (9, [1, 2, 4, 8, 9]),
    (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 20]),
    (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
])
def test_bucket_sizes(max_batch, want):
    assert bucket_sizes(max_batch) == want


@given(st.integers(1, 600))
def test_buckets_cover_every_batch_up_to_the_limit(max_batch):
    b = bucket_sizes(max_batch)
    assert b == sorted(set(b)) and b[0] == 1 and b[-1] == max_batch
    assert all(y - x <= 8 for x, y in zip(b, b[1:]))  # padding waste stays under 8 rows


@pytest.mark.parametrize("batch, want", [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (9, 16), (17, 20), (20, 20),
                                         (21, None)])
def test_pick_bucket(batch, want):
    assert pick_bucket(batch, [1, 2, 4, 8, 16, 20]) == want


@given(st.integers(1, 200), st.integers(1, 220))
def test_pick_bucket_is_the_smallest_that_fits(max_batch, batch):
    buckets = bucket_sizes(max_batch)
    got = pick_bucket(batch, buckets)
    if batch > max_batch:
        assert got is None
    else:
        assert got in buckets and got >= batch
        assert all(b < batch for b in buckets if b < got)
