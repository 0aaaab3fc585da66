"""The goodput knee of a sweep (router/stats/knee.py) on hand-worked sweeps: interpolated
where the sweep brackets it, censored (`>= top`, `< bottom`) where it does not -- a sweep
that never misses is never reported as a knee."""
from __future__ import annotations

import pytest

from pdserve.router.stats.knee import Knee, goodput_knee, knee_bounds


def test_a_bracketed_knee_is_interpolated_between_the_last_pass_and_the_first_miss():
    expected = 2 + (0.95 - 0.9) * (4 - 2) / (0.95 - 0.5)  # 2.2222
    k = goodput_knee([1, 2, 4], [1.0, 0.95, 0.5])
    assert k.rate == pytest.approx(expected) and k.censored is None and k.measured
    assert goodput_knee([4, 1, 2], [0.5, 1.0, 0.95]).rate == pytest.approx(expected)  # order does not matter
    assert k.text() == "2.22 req/s"


def test_a_sweep_that_never_misses_is_censored_at_its_top_not_a_knee():
    k = goodput_knee([1, 2, 4], [1.0, 0.99, 0.91])
    assert k == Knee(4, "above") and not k.measured
    assert k.text().startswith(">= 4.00 req/s") and "censored" in k.text()
    assert k.as_json()["censored"] == "above"


def test_a_sweep_missing_at_its_lowest_rate_is_censored_at_its_bottom():
    k = goodput_knee([1, 2, 4], [0.8, 0.95, 0.1])  # a later pass does not undo the first miss
    assert k == Knee(1, "below") and not k.measured and k.text().startswith("< 1.00 req/s")


def test_the_first_miss_decides_even_if_a_higher_rate_passes_again():
    # attainment >= 90% "there and at every lower rate": 0.8 at 2 req/s ends it
    k = goodput_knee([1, 2, 3], [1.0, 0.8, 0.95])
    assert k.rate == pytest.approx(1 + 0.1 / 0.2) and k.censored is None


def test_edges():
    assert goodput_knee([1, 2], [0.9, 0.5]).rate == pytest.approx(1.0)  # exactly at target meets it
    assert goodput_knee([1, 2, 4], [1.0, 0.8, 0.2], target=0.5).rate == pytest.approx(2 + 0.3 * 2 / 0.6)
    assert goodput_knee([], []) == Knee(None) and goodput_knee([], []).text() == "no sweep points"
    assert goodput_knee([3], [0.95]) == Knee(3, "above")


def test_knee_at_the_interval_ends():
    # lower ends: 0.85 at 2 already misses -> between 1 (0.95) and 2: 1 + 0.05 / 0.10 = 1.5;
    # upper ends never miss -> censored at the top
    b = knee_bounds([1, 2, 4], [0.95, 0.85, 0.40], [1.0, 0.99, 0.95])
    assert b["from_lower"]["rate"] == pytest.approx(1.5) and b["from_lower"]["censored"] is None
    assert b["from_upper"] == Knee(4, "above").as_json()
