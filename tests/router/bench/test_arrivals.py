"""Arrival processes of `pdserve bench` (router/bench/arrivals.py): gamma gaps with mean
1/rate and shape `burstiness` (1 = Poisson, CV 1; 0.5 = burstier, CV sqrt(2)), seeded."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pdserve.router.bench.arrivals import arrival_times

N = 20_000


@pytest.mark.parametrize("burstiness, cv", [(1.0, 1.0), (0.5, math.sqrt(2)), (4.0, 0.5)])
@pytest.mark.parametrize("rate", [3.0, 40.0])
def test_mean_rate_and_burstiness(rate, burstiness, cv):
    times = np.asarray(arrival_times(N, rate, burstiness, seed=7))
    gaps = np.diff(times)
    assert (N - 1) / times[-1] == pytest.approx(rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.05)


def test_times_start_at_zero_and_never_go_back():
    times = arrival_times(1000, 5.0, 0.5, seed=1)
    assert len(times) == 1000 and times[0] == 0.0
    assert all(b >= a for a, b in zip(times, times[1:]))


def test_same_seed_same_times():
    assert arrival_times(500, 5.0, 1.0, seed=3) == arrival_times(500, 5.0, 1.0, seed=3)
    assert arrival_times(500, 5.0, 1.0, seed=3) != arrival_times(500, 5.0, 1.0, seed=4)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_times(4, float("inf")) == [0.0] * 4


@pytest.mark.parametrize("rate, burstiness", [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_bad_rate_or_burstiness_is_rejected(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_times(4, rate, burstiness)

