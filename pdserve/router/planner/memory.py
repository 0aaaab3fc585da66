"""What the one-host planner remembers of a layout it tried: the load its figures were
measured under (`Load`) and its score over those requests (`Remembered`), with the rules
for when a remembered score still applies -- seen recently, under a load like the present
one. The rule that keeps and weighs them is router/planner/rule.py."""
from __future__ import annotations

import math
from typing import NamedTuple, Protocol

class Trust(Protocol):
    """How long and within what change of load a remembered score is trusted (the planner's
    config, router/planner/rule.py `PlannerConfig`)."""

    memory_s: float
    load_band: float


RATE_Z = 1.96  # two measured rates differ where their log ratio passes this many standard errors (and the band)


class Load(NamedTuple):
    """The load a window's figures were measured under: requests sent a second, and their
    mean prompt and output lengths in tokens (router/planner/loop.py: the latest minutes),
    over `requests` requests (0: not known)."""

    rate: float
    prompt_tokens: float
    output_tokens: float
    requests: int = 0

    def like(self, other: Load, band: float) -> bool:
        """Whether each figure is within `band` x of `other`'s; the rates, counts of Poisson
        arrivals where both counts are known, also within `RATE_Z` standard errors of their
        log ratio (sqrt(1/n1 + 1/n2)): at 0.125 req/s two minutes hold ~15 requests, and a
        lull of 7 in one of them (0.058 req/s) is the same load, not one 2x lighter."""
        rate_band = band
        if self.requests and other.requests:
            rate_band = max(band, math.exp(RATE_Z * math.sqrt(1 / self.requests + 1 / other.requests)))
        return all(_within(a, b, f) for a, b, f in ((self.rate, other.rate, rate_band),
                                                     (self.prompt_tokens, other.prompt_tokens, band),
                                                     (self.output_tokens, other.output_tokens, band)))


def _within(a: float, b: float, factor: float) -> bool:
    return max(a, b) <= factor * min(a, b) if min(a, b) > 0 else a == b


class Remembered(NamedTuple):
    """One layout's measured score: the mean over `requests`, last updated at `seen`
    (monotonic seconds), under `load` (None: not known)."""

    layout: str
    score: float
    requests: int
    seen: float
    load: Load | None = None

    def applies(self, now: float, load: Load | None, cfg: Trust) -> bool:
        """Seen within `memory_s` and, where both loads are known, under a load like `load`."""
        return now - self.seen <= cfg.memory_s and (self.load is None or load is None
                                                    or self.load.like(load, cfg.load_band))
