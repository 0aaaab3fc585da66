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

