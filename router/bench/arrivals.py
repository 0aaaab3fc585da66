"""Arrival processes: send times (seconds from start) for n requests."""
from __future__ import annotations

import numpy as np


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Gamma-distributed gaps with mean 1/rate; burstiness 1.0 is Poisson, < 1 burstier,
    > 1 more regular (vLLM's convention). rate = inf sends everything at once."""
    if rate == float("inf"):
        return [0.0] * n
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate} and {burstiness}")
    rng = np.random.default_rng(seed)
    theta = 1.0 / (rate * burstiness)
    gaps = rng.gamma(shape=burstiness, scale=theta, size=n)
    times = np.cumsum(gaps) - gaps[0]  # the first request goes at t=0
    return times.tolist()


def scale_timestamps(timestamps_ms: list[float], time_scale: float) -> list[float]:
    """Trace replay: seconds from the first arrival, divided by time_scale (2 = twice the rate)."""
    if not timestamps_ms:
        return []
    t0 = timestamps_ms[0]
    return [(t - t0) / 1000.0 / time_scale for t in timestamps_ms]
