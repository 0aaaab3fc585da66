"""Latency/SLO math of `pdserve bench` (router/stats/latency.py) on fixed synthetic timings
whose answers are worked out by hand below (DESIGN.md: TTFT, TPOT, pooled ITL, E2E,
SLO attainment, goodput and the DistServe goodput rate)."""
from __future__ import annotations

import pytest

from pdserve.router.stats.latency import RequestRecord, attainment, meets_slo, phase_breakdown, summarize

MS = 1e-3


def _record(send: float, ttft_ms: float, gaps_ms: list[float], prompt_len: int = 100) -> RequestRecord:
    """A request sent at `send` s whose first token came ttft_ms later, then one token per gap."""
    t = send + ttft_ms * MS
    times = [t]
    for g in gaps_ms:
        t += g * MS
        times.append(t)
    return RequestRecord(send, times, prompt_len)


# Per request (ms): TTFT, gaps between tokens -> E2E, TPOT = (E2E - TTFT) / (out - 1)
#   r0: 10, [20, 40]       -> E2E  70, TPOT 30
#   r1: 20, [10]           -> E2E  30, TPOT 10
#   r2: 30, []             -> E2E  30, TPOT -  (one output token)
#   r3: 40, [5, 5, 5, 5]   -> E2E  60, TPOT  5
#   r4: 100, [50, 70]      -> E2E 220, TPOT 60
#   r5: failed, no tokens  -> excluded from latency stats, never meets an SLO
def _records() -> list[RequestRecord]:
    recs = [_record(0.0, 10, [20, 40]), _record(1.0, 20, [10]), _record(2.0, 30, []),
            _record(3.0, 40, [5, 5, 5, 5]), _record(4.0, 100, [50, 70])]
    recs.append(RequestRecord(5.0, [], 7, success=False, error="RuntimeError: boom"))
    return recs


def test_per_request_latencies():
    r0, r1, r2, r3, r4, r5 = _records()
    assert r0.ttft == pytest.approx(0.010) and r0.e2e == pytest.approx(0.070)
    assert r0.tpot == pytest.approx(0.030)
    assert r0.itls == pytest.approx([0.020, 0.040])
    assert r3.tpot == pytest.approx(0.005) and r3.output_len == 5
    assert r2.output_len == 1 and r2.tpot is None and r2.itls == []
    assert r2.ttft == pytest.approx(r2.e2e)
    assert r5.ttft is None and r5.e2e is None and r5.tpot is None


def test_summarize_counts_and_throughput():
    res = summarize(_records(), duration_s=10.0)
    assert res["completed"] == 5 and res["failed"] == 1
    assert res["total_input_tokens"] == 500  # the failed request's 7 tokens are not counted
    assert res["total_output_tokens"] == 3 + 2 + 1 + 5 + 3
    assert res["duration"] == 10.0
    assert res["request_throughput"] == pytest.approx(0.5)
    assert res["output_throughput"] == pytest.approx(1.4)
    assert res["total_token_throughput"] == pytest.approx(51.4)


def test_summarize_ttft_and_e2e_statistics():
    res = summarize(_records(), duration_s=10.0, percentiles=(90, 99))
    # TTFT [10, 20, 30, 40, 100]: numpy's linear percentiles sit at index p/100 * (n - 1).
    assert res["mean_ttft_ms"] == pytest.approx(40.0)
    assert res["median_ttft_ms"] == pytest.approx(30.0)
    assert res["std_ttft_ms"] == pytest.approx(1000 ** 0.5)  # population std: sqrt(5000 / 5)
    assert res["p90_ttft_ms"] == pytest.approx(40 + 0.6 * 60)  # index 3.6
    assert res["p99_ttft_ms"] == pytest.approx(40 + 0.96 * 60)  # index 3.96
    # E2E [70, 30, 30, 60, 220] -> sorted [30, 30, 60, 70, 220]
    assert res["mean_e2el_ms"] == pytest.approx(82.0)
    assert res["median_e2el_ms"] == pytest.approx(60.0)
    assert res["p90_e2el_ms"] == pytest.approx(70 + 0.6 * 150)
    assert res["p99_e2el_ms"] == pytest.approx(70 + 0.96 * 150)


def test_summarize_tpot_skips_one_token_requests():
    res = summarize(_records(), duration_s=10.0)
    # TPOT [30, 10, 5, 60] (r2 has no TPOT) -> sorted [5, 10, 30, 60]
    assert res["mean_tpot_ms"] == pytest.approx(26.25)
    assert res["median_tpot_ms"] == pytest.approx(20.0)
    assert res["p90_tpot_ms"] == pytest.approx(30 + 0.7 * 30)  # index 2.7
    assert res["p99_tpot_ms"] == pytest.approx(30 + 0.97 * 30)  # index 2.97


def test_summarize_itl_pools_every_gap():
    res = summarize(_records(), duration_s=10.0)
    # all 9 gaps pooled: [20, 40, 10, 5, 5, 5, 5, 50, 70] -> sorted [5, 5, 5, 5, 10, 20, 40, 50, 70]
    assert res["mean_itl_ms"] == pytest.approx(210 / 9)  # not the mean of per-request means (26.25)
    assert res["median_itl_ms"] == pytest.approx(10.0)
    assert res["p90_itl_ms"] == pytest.approx(50 + 0.2 * 20)  # index 7.2
    assert res["p99_itl_ms"] == pytest.approx(50 + 0.92 * 20)  # index 7.92


@pytest.mark.parametrize("ttft_ms, tpot_ms, passing", [
    (35, None, {0, 1, 2}),       # TTFT only
    (None, 20, {1, 2, 3}),       # TPOT only: r2 (one token) passes any TPOT bound
    (35, 20, {1, 2}),            # both: the intersection
    (None, None, {0, 1, 2, 3, 4}),  # no SLO: every completed request
    (1000, 1000, {0, 1, 2, 3, 4}),
])
def test_attainment_and_goodput(ttft_ms, tpot_ms, passing):
    recs = _records()
    ttft_s = ttft_ms * MS if ttft_ms is not None else None
    tpot_s = tpot_ms * MS if tpot_ms is not None else None
    assert {i for i, r in enumerate(recs) if meets_slo(r, ttft_s, tpot_s)} == passing
    # the failed request counts in the denominator and never meets an SLO
    assert attainment(recs, ttft_s, tpot_s) == pytest.approx(len(passing) / 6)
    res = summarize(recs, duration_s=10.0, slo_ttft_s=ttft_s, slo_tpot_s=tpot_s)
    assert res["slo_attainment"] == pytest.approx(len(passing) / 6)
    assert res["request_goodput"] == pytest.approx(len(passing) / 10.0)  # good requests per second


def test_one_token_request_is_judged_on_ttft_only():
    one = _record(0.0, 30, [])
    assert meets_slo(one, 0.040, 1e-9)
    assert not meets_slo(one, 0.020, 1e-9)
    assert not meets_slo(one, 0.020, None)


def test_attainment_of_nothing_is_zero():
    assert attainment([], 1.0, 1.0) == 0.0


def test_phase_breakdown_means_per_phase():
    base = {"prefill_queued": 0.0, "prefill_start": 0.010, "prefill_end": 0.030, "kv_ready": 0.034,
            "first_token": 0.035, "finish": 0.135}
    recs = [RequestRecord(0.0, [1.0], timeline=base),
            RequestRecord(0.0, [1.0], timeline={k: v * 3 for k, v in base.items()}),
            RequestRecord(0.0, [1.0], timeline={"first_token": 0.0, "finish": 0.1}),  # colocated: no P phases
            RequestRecord(0.0, [1.0], timeline=None)]
    out = phase_breakdown(recs)
    assert out["mean_prefill_queue_ms"] == pytest.approx((10 + 30) / 2)
    assert out["mean_prefill_ms"] == pytest.approx((20 + 60) / 2)
    assert out["mean_kv_transfer_ms"] == pytest.approx((4 + 12) / 2)
    assert out["mean_decode_queue_ms"] == pytest.approx((1 + 3) / 2)
    assert out["mean_decode_ms"] == pytest.approx((100 + 300 + 100) / 3)
    assert phase_breakdown([RequestRecord(0.0, [1.0])]) == {}
