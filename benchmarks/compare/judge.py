"""Judging a comparison's points (pure): each point's attainment under each regime with its
Wilson 95% interval, and each system's goodput knee per regime, censored where its sweep
does not bracket it (router/stats)."""
from __future__ import annotations

from pdserve.router.stats.intervals import wilson_interval
from pdserve.router.stats.knee import goodput_knee, knee_bounds
from pdserve.router.stats.latency import RequestRecord, meets_slo


def attainment_under(records: list[RequestRecord], regime: dict, duration_s: float) -> dict:
    """Share of `records` meeting both of the regime's SLOs (a failed request misses), its
    Wilson interval and counts, and the goodput (requests meeting both per second of the run)."""
    met = sum(meets_slo(r, regime["ttft_ms"] / 1000, regime["tpot_ms"] / 1000) for r in records)
    n = len(records)
    return {"slo_attainment": met / n if n else 0.0, "slo_attainment_ci95": list(wilson_interval(met, n)),
            "slo_met": met, "slo_requests": n, "request_goodput": met / duration_s if duration_s > 0 else 0.0}


def knees(points: dict[str, list[dict]], regimes: dict[str, dict]) -> dict[str, dict[str, dict]]:
    """Per regime, per system judged under it: the knee of its measured points (a point
    without `by_regime[regime]` -- a planner of another regime, a skipped point -- is left out)."""
    out: dict[str, dict[str, dict]] = {}
    for regime in regimes:
        out[regime] = {}
        for system, pts in points.items():
            own = [p for p in pts if regime in p.get("by_regime", {})]
            if not own:
                continue
            rates = [p["request_rate"] for p in own]
            att = [p["by_regime"][regime] for p in own]
            knee = goodput_knee(rates, [a["slo_attainment"] for a in att]).as_json()
            knee["interval_ends"] = knee_bounds(rates, [a["slo_attainment_ci95"][0] for a in att],
                                                [a["slo_attainment_ci95"][1] for a in att])
            out[regime][system] = knee
    return out
