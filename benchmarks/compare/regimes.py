"""SLO regimes derived by a declared rule (DESIGN.md "Metrics"): each bound a multiple of the
slower system's unloaded latency measured in the same run, so that no regime sits below a
compared system's unloaded TTFT or TPOT (every multiple is >= 1).

The default rule (DistServe-style SLO scales):
- `ttft_bound`: TTFT <= 3 x and TPOT <= 10 x -- a tight first token, room for batching;
- `tpot_bound`: TTFT <= 10 x and TPOT <= 2 x -- tight decode pacing, room for queueing.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Rule:
    """One regime's multiples of the slower system's unloaded TTFT and TPOT."""

    ttft_x: float
    tpot_x: float

    def __post_init__(self) -> None:
        if self.ttft_x < 1 or self.tpot_x < 1:
            raise ValueError(f"a regime below the slower system's unloaded latency measures kernel speed, not "
                             f"scheduling: multiples must be >= 1, got TTFT x{self.ttft_x}, TPOT x{self.tpot_x}")


DEFAULT_RULES = {"ttft_bound": Rule(3.0, 10.0), "tpot_bound": Rule(10.0, 2.0)}


def parse_rules(text: str) -> dict[str, Rule]:
    """`name=TTFTx:TPOTx,...`, e.g. `ttft_bound=3:10,tpot_bound=10:2`."""
    rules = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, xs = part.partition("=")
        try:
            a, b = (float(x) for x in xs.split(":"))
        except ValueError:
            raise ValueError(f"regime {part!r}: expected NAME=TTFT_MULTIPLE:TPOT_MULTIPLE") from None
        rules[name.strip()] = Rule(a, b)
    if not rules:
        raise ValueError("no regimes given")
    return rules


def derive(unloaded: dict[str, dict], rules: dict[str, Rule]) -> dict:
    """The regimes from every system's unloaded medians (`{system: {"ttft_ms", "tpot_ms"}}`):
    per regime its SLOs in ms and the systems whose latency set them."""
    if not unloaded:
        raise ValueError("no unloaded latencies to derive regimes from")
    slow_ttft = max(unloaded, key=lambda s: unloaded[s]["ttft_ms"])
    slow_tpot = max(unloaded, key=lambda s: unloaded[s]["tpot_ms"])
    base_ttft, base_tpot = unloaded[slow_ttft]["ttft_ms"], unloaded[slow_tpot]["tpot_ms"]
    return {name: {"ttft_ms": round(r.ttft_x * base_ttft, 1), "tpot_ms": round(r.tpot_x * base_tpot, 2),
                   "rule": asdict(r), "slower_unloaded": {"ttft_ms": base_ttft, "ttft_of": slow_ttft,
                                                          "tpot_ms": base_tpot, "tpot_of": slow_tpot}}
            for name, r in rules.items()}
