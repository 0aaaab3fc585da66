"""The intervals `pdserve bench` reports (router/stats/intervals.py), against cases worked out
by hand: Wilson's score interval of an attainment, and percentile-bootstrap intervals of a
latency percentile."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.router.stats.intervals import MIN_REQUESTS_PER_POINT, Z95, bootstrap_percentiles, wilson_interval
from pdserve.router.stats.latency import RequestRecord, summarize


def wilson_by_hand(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """(p + z²/2n ± z sqrt(p(1-p)/n + z²/4n²)) / (1 + z²/n), written out once more."""
    p = k / n
    centre = p + z * z / (2 * n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - half) / (1 + z * z / n), (centre + half) / (1 + z * z / n)


def test_wilson_95_of_100():
    # p = 0.95, z = 1.96: centre 0.969208 / 1.038416 = 0.93335, half 0.046837 / 1.038416 = 0.04510
    lo, hi = wilson_interval(95, 100)
    assert (lo, hi) == pytest.approx((0.88825, 0.97846), abs=5e-5)
    assert (lo, hi) == pytest.approx(wilson_by_hand(95, 100, Z95), abs=1e-12)


def test_wilson_at_the_edges_has_width_a_normal_interval_would_not():
    # 0 of n: [0, z² / (n + z²)]; n of n: [n / (n + z²), 1] -- the normal approximation says [1, 1]
    z2 = Z95 * Z95
    assert wilson_interval(0, 10) == pytest.approx((0.0, z2 / (10 + z2)))  # (0, 0.2775)
    assert wilson_interval(10, 10) == pytest.approx((10 / (10 + z2), 1.0))  # (0.7225, 1)
    lo, hi = wilson_interval(100, 100)
    assert hi == 1.0 and lo == pytest.approx(0.96301, abs=5e-5)
    assert wilson_interval(0, 10)[0] == 0.0 and wilson_interval(10, 10)[1] == 1.0  # exactly, not 1 - 1e-16


def test_wilson_is_symmetric_and_narrows_with_n():
    lo, hi = wilson_interval(3, 10)
    lo2, hi2 = wilson_interval(7, 10)
    assert (lo, hi) == pytest.approx((1 - hi2, 1 - lo2))
    assert wilson_interval(30, 100)[1] - wilson_interval(30, 100)[0] < hi - lo


def test_wilson_refuses_impossible_counts():
    assert wilson_interval(0, 0) == (0.0, 1.0)
    for k, n in ((-1, 5), (6, 5), (0, -1)):
        with pytest.raises(ValueError):
            wilson_interval(k, n)


def test_one_request_moves_attainment_by_at_most_one_point_at_the_default():
    assert 1 / MIN_REQUESTS_PER_POINT <= 0.01


def test_bootstrap_of_two_values_spans_both():
    # resamples of [0, 10] have medians 0 (1/4), 5 (1/2), 10 (1/4): the 2.5th and 97.5th
    # percentiles of 1000 such medians are 0 and 10
    (lo, hi), = bootstrap_percentiles([0.0, 10.0], [50]).values()
    assert (lo, hi) == (0.0, 10.0)


def test_bootstrap_of_equal_values_has_no_width_and_one_value_is_itself():
    assert bootstrap_percentiles([3.0] * 50, [50, 99]) == {50: (3.0, 3.0), 99: (3.0, 3.0)}
    assert bootstrap_percentiles([7.0], [90]) == {90: (7.0, 7.0)}
    assert bootstrap_percentiles([], [50]) == {}


def test_bootstrap_is_seeded_and_its_median_interval_has_the_asymptotic_width():
    # the sample median of n normal draws has standard error sqrt(pi / 2) sigma / sqrt(n)
    x = np.random.default_rng(1).normal(100.0, 10.0, size=2000)
    a = bootstrap_percentiles(x, [50, 99])
    assert a == bootstrap_percentiles(x, [50, 99])  # fixed seed: the same records, the same interval
    lo, hi = a[50]
    assert lo < np.median(x) < hi
    expected = 2 * 1.96 * math.sqrt(math.pi / 2) * 10.0 / math.sqrt(2000)  # 1.09
    assert hi - lo == pytest.approx(expected, rel=0.25)
    lo99, hi99 = a[99]
    assert lo99 < np.percentile(x, 99) < hi99 and hi99 - lo99 > hi - lo  # a tail is known less well


def test_summarize_carries_the_intervals_beside_vllms_keys():
    # 10 requests, TTFT 10..100 ms, 3 tokens 5 ms apart; TTFT SLO 75 ms: 7 of 10 meet it
    recs = [RequestRecord(float(i), [i + 0.01 * (i + 1) + 0.005 * k for k in range(3)], 10) for i in range(10)]
    res = summarize(recs, 20.0, slo_ttft_s=0.075)
    assert res["slo_attainment"] == pytest.approx(0.7) and (res["slo_met"], res["slo_requests"]) == (7, 10)
    assert res["slo_attainment_ci95"] == pytest.approx(list(wilson_interval(7, 10)))
    lo, hi = res["p99_ttft_ms_ci95"]
    assert lo <= res["p99_ttft_ms"] <= hi <= 100.0 + 1e-9
    assert res["median_tpot_ms_ci95"] == pytest.approx([5.0, 5.0])
    for key in ("median_ttft_ms_ci95", "p90_ttft_ms_ci95", "p99_itl_ms_ci95", "p90_e2el_ms_ci95"):
        assert key in res
    assert "Wilson" in res["intervals"]["slo_attainment_ci95"]
    assert "p99_ttft_ms_ci95" not in summarize(recs, 20.0, ci=False)
