"""Latency and SLO math over per-request timings (pure functions; times in seconds).

Definitions (DESIGN.md): TTFT = first token - send; TPOT = (E2E - TTFT) / (out - 1);
ITL = every gap between streamed tokens, pooled; E2E = last token - send.
SLO attainment = share of requests meeting every given SLO; goodput = requests meeting
all SLOs per second of the run. Intervals: stats/intervals.py; the sweep's knee: stats/knee.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pdserve.router.stats.intervals import (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED, bootstrap_percentiles,
                                            wilson_interval)


@dataclass
class RequestRecord:
    """One request as the client saw it."""

    send_time: float
    token_times: list[float] = field(default_factory=list)  # arrival time of every output token
    prompt_len: int = 0
    success: bool = True
    error: str = ""
    timeline: dict[str, float] | None = None  # the server's per-request timeline, if asked for

    @property
    def output_len(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> float | None:
        return self.token_times[-1] - self.send_time if self.token_times else None

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)  # type: ignore[operator]

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def meets_slo(r: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """A request meets the SLOs if it succeeded and each given bound holds (a one-token
    request has no TPOT and meets any TPOT bound)."""
    if not r.success or r.ttft is None:
        return False
    if slo_ttft_s is not None and r.ttft > slo_ttft_s:
        return False
    if slo_tpot_s is not None and r.tpot is not None and r.tpot > slo_tpot_s:
        return False
    return True


def attainment(records: list[RequestRecord], slo_ttft_s: float | None, slo_tpot_s: float | None) -> float:
    if not records:
        return 0.0
    return sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records) / len(records)


def _stats(name: str, values_s: list[float], percentiles: list[float], ci: bool) -> dict:
    """vLLM-style mean/median/std/pNN in milliseconds, and beside each percentile (the median
    included) its bootstrap 95% interval as `<key>_ci95`: [low, high]."""
    arr = np.asarray(values_s, dtype=float) * 1000.0
    empty = arr.size == 0
    if empty:
        arr = np.zeros(1)
    out: dict = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
                 f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    if ci and not empty:
        pcts = sorted({50.0, *percentiles})
        for p, (lo, hi) in bootstrap_percentiles(arr, pcts).items():
            out[f"{'median' if p == 50 else f'p{p:g}'}_{name}_ms_ci95"] = [lo, hi]
    return out


def summarize(records: list[RequestRecord], duration_s: float, slo_ttft_s: float | None = None,
              slo_tpot_s: float | None = None, percentiles: tuple[float, ...] = (90, 99), ci: bool = True) -> dict:
    """The aggregate result with vLLM `bench serve` key names, plus SLO attainment with its
    Wilson 95% interval (`slo_attainment_ci95`, over `slo_requests` requests of which `slo_met`
    met every SLO; a failed request counts as a miss) and, with `ci`, bootstrap 95% intervals
    of the latency percentiles (`p99_ttft_ms_ci95`, ...)."""
    ok = [r for r in records if r.success and r.output_len > 0]
    good = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in records)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    res = {
        "duration": duration_s,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else 0.0,
        "request_goodput": good / duration_s if duration_s > 0 else 0.0,
        "output_throughput": total_out / duration_s if duration_s > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration_s if duration_s > 0 else 0.0,
        "slo_attainment": good / len(records) if records else 0.0,
        "slo_attainment_ci95": list(wilson_interval(good, len(records))),
        "slo_met": good,
        "slo_requests": len(records),
    }
    pct = list(percentiles)
    if 50 not in pct:
        pct = [50, *pct]
    res.update(_stats("ttft", [r.ttft for r in ok], pct, ci))
    res.update(_stats("tpot", [r.tpot for r in ok if r.tpot is not None], pct, ci))
    res.update(_stats("itl", [x for r in ok for x in r.itls], pct, ci))
    res.update(_stats("e2el", [r.e2e for r in ok], pct, ci))
    if ci:
        res["intervals"] = INTERVALS
    return res


# How the intervals in a summary were made (written into the JSON beside them).
INTERVALS = {"slo_attainment_ci95": "Wilson score interval, 95%",
             "percentile_ci95": f"percentile bootstrap over requests (ITL: over pooled gaps), {BOOTSTRAP_RESAMPLES} "
                                f"resamples, seed {BOOTSTRAP_SEED}, 95%"}


# Phases of the server timeline, in request order; each is (name, start key, end key).
PHASES = (("prefill_queue", "prefill_queued", "prefill_start"),
          ("prefill", "prefill_start", "prefill_end"),
          ("kv_transfer", "prefill_end", "kv_ready"),
          ("decode_queue", "kv_ready", "first_token"),
          ("decode", "first_token", "finish"))


def phase_breakdown(records: list[RequestRecord]) -> dict[str, float]:
    """Mean milliseconds per phase over requests whose timeline has both ends of it."""
    out = {}
    for name, a, b in PHASES:
        vals = [(r.timeline[b] - r.timeline[a]) * 1000 for r in records
                if r.timeline and a in r.timeline and b in r.timeline]
        if vals:
            out[f"mean_{name}_ms"] = float(np.mean(vals))
    return out
