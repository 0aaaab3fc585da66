"""Confidence intervals for what `pdserve bench` reports (pure functions).

- SLO attainment is a share of n requests: its 95% interval is Wilson's score interval,
  which stays inside [0, 1] and is sound at 0 / n and n / n (the normal approximation
  gives [1, 1] at 100%, claiming a certainty 100 requests cannot give).
- A latency percentile has no closed-form interval: a percentile bootstrap (resample the
  requests with replacement, take the percentile of each resample, keep the 2.5th and 97.5th
  of those) with a fixed seed, so that the same records always give the same interval.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

Z95 = 1.959963984540054  # the standard normal's 97.5th percentile
BOOTSTRAP_RESAMPLES = 1000
BOOTSTRAP_SEED = 0
# The default requests per point: one request then moves attainment by 1 / 100 = 1 point.
MIN_REQUESTS_PER_POINT = 100


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a share `successes / n` (95% at the default z).
    (0.0, 1.0) for n = 0: nothing measured, nothing excluded."""
    if n < 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n, got {successes} of {n}")
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # at 0 / n and n / n the interval touches the edge exactly; rounding must not cross it
    return max(0.0, centre - half) if successes else 0.0, min(1.0, centre + half) if successes < n else 1.0


def bootstrap_percentiles(values: Sequence[float], percentiles: Sequence[float], *,
                          resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                          level: float = 0.95) -> dict[float, tuple[float, float]]:
    """Percentile-bootstrap intervals of the given percentiles (0-100) of `values`: for each,
    (low, high). An empty sample gives no intervals; one value gives (v, v)."""
    arr = np.asarray(values, dtype=float)
    if arr.size == 0:
        return {}
    rng = np.random.default_rng(seed)
    tail = (1 - level) / 2 * 100
    stats = np.empty((len(percentiles), resamples))
    # resampled in chunks so that a pooled ITL sample of ~10^4 gaps stays a few MB at a time
    chunk = max(1, 2_000_000 // arr.size)
    for start in range(0, resamples, chunk):
        k = min(chunk, resamples - start)
        sample = arr[rng.integers(0, arr.size, size=(k, arr.size))]  # [k, n]
        stats[:, start:start + k] = np.percentile(sample, list(percentiles), axis=1)
    lo, hi = np.percentile(stats, [tail, 100 - tail], axis=1)
    return {p: (float(a), float(b)) for p, a, b in zip(percentiles, lo, hi)}
