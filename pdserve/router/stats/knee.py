"""The goodput knee of a request-rate sweep (DistServe; DESIGN.md "Metrics"): the highest
rate at which SLO attainment is >= the target there and at every lower rate of the sweep,
interpolated linearly between the last point that meets the target and the first that
misses it.

A sweep that does not bracket the knee says only a bound, and the result says which:
- `above`: no rate of the sweep misses: the knee is at or above the top rate (`>= top`);
- `below`: the lowest rate already misses: the knee is below it (`< bottom`).
Neither is a measured knee, and neither may be reported or compared as one.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

TARGET = 0.9  # DistServe's attainment target


@dataclass(frozen=True)
class Knee:
    """A sweep's knee: `rate` (req/s) is the interpolated knee when `censored` is None, the
    top rate when it is `above`, the bottom rate when it is `below`; None for an empty sweep."""

    rate: float | None
    censored: str | None = None  # None | "above" | "below"
    target: float = TARGET

    @property
    def measured(self) -> bool:
        """True only for a knee the sweep brackets."""
        return self.rate is not None and self.censored is None

    def text(self, unit: str = " req/s") -> str:
        if self.rate is None:
            return "no sweep points"
        if self.censored == "above":
            return f">= {self.rate:.2f}{unit} (censored: no rate of the sweep misses {self.target:.0%})"
        if self.censored == "below":
            return f"< {self.rate:.2f}{unit} (censored: the lowest rate already misses {self.target:.0%})"
        return f"{self.rate:.2f}{unit}"

    def as_json(self) -> dict:
        return {"rate": self.rate, "censored": self.censored, "target": self.target, "text": self.text()}


def goodput_knee(rates: Sequence[float], attainments: Sequence[float], target: float = TARGET) -> Knee:
    """The knee of a sweep given as (rate, attainment) pairs in any order."""
    pts = sorted(zip(rates, attainments))
    if not pts:
        return Knee(None, None, target)
    if pts[0][1] < target:
        return Knee(pts[0][0], "below", target)
    for (r0, a0), (r1, a1) in zip(pts, pts[1:]):
        if a1 < target:  # the first miss: the knee lies in [r0, r1)
            return Knee(r0 + (a0 - target) * (r1 - r0) / (a0 - a1), None, target)
    return Knee(pts[-1][0], "above", target)


def knee_bounds(rates: Sequence[float], lows: Sequence[float], highs: Sequence[float],
                target: float = TARGET) -> dict:
    """The knee again from each point's interval ends: from the lower ends (a knee the data
    support at the interval's pessimistic edge) and from the upper ends (the optimistic edge).
    Their spread is how far the sweep's sampling noise alone could move the knee."""
    return {"from_lower": goodput_knee(rates, lows, target).as_json(),
            "from_upper": goodput_knee(rates, highs, target).as_json()}
