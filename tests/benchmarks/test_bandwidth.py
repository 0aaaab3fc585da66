"""benchmarks/harness/bandwidth.py: the streaming read reads every byte once (its sum is the
buffer's, for any length and thread count), and a bound says which memory it is of."""
from __future__ import annotations

import numpy as np
import pytest

from tests.support.bench_scripts import script

bw = script("harness.bandwidth")


@pytest.mark.parametrize("n,threads", [(1, 1), (31, 2), (1000, 1), (100_003, 2)])
def test_the_read_sums_every_element_once(n, threads):
    buf = np.arange(n, dtype=np.float32) % 7  # small integers: exact in float32 and float64
    assert bw._library().pd_stream_read(buf.ctypes.data, buf.size, threads) == pytest.approx(float(buf.sum()))


def test_a_bound_says_whether_the_working_set_fits_in_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(bw, "last_level_cache_bytes", lambda: 32 << 20)
    small = bw.bound_facts(16 << 20, 2, 50e9, None, None)
    assert small["fits_in_llc"] and "last-level cache" in small["bound_of"] and small["read_gb_s"] == 50.0
    big = bw.bound_facts(97 << 20, 2, 20e9, 51.2, "datasheet")
    assert not big["fits_in_llc"] and big["bound_of"].startswith("DRAM") and big["nominal_gb_s"] == 51.2
    assert bw.stream_read_bandwidth(1 << 20, 1, rounds=1) > 0
