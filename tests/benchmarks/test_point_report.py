"""benchmarks/point_report.py, on made-up points: the median over a rate's repeats, and
this checkout's figures over the baseline checkout's and over vLLM's."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report():
    """The module as the scripts import it: benchmarks/ on sys.path (for its sibling
    servers.py) while it loads, then put back."""
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import point_report
        yield point_report
    finally:
        sys.path[:] = saved


def point(rate, ttft, tpot, attain):
    return {"request_rate": rate, "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": 2 * tpot, "slo_attainment": attain, "request_goodput": attain * rate,
            "output_throughput": 60.0}


def test_median_point_is_per_metric_and_skips_failed_points(report):
    pts = [point(1.0, 300, 20, 1.0), point(1.0, 200, 40, 0.5), {"request_rate": 1.0, "error": "timed out"},
           point(1.0, 250, 10, 0.9)]
    m = report.median_point(1.0, pts)
    assert (m["mean_ttft_ms"], m["mean_tpot_ms"], m["slo_attainment"], m["repeats"]) == (250, 20, 0.9, 3)
    assert m["request_rate"] == 1.0


def test_median_point_of_failures_names_the_error_and_rate(report):
    m = report.median_point(3.0, [{"request_rate": 3.0, "error": "timed out after 600 s"}])
    assert m == {"request_rate": 3.0, "error": "timed out after 600 s"}


def test_baseline_ratios_divide_this_checkout_by_the_baseline_and_by_vllm(report):
    serving = {"pdserve-colocated": {"sweep": [point(1.0, 100, 10, 1.0), point(3.0, 200, 20, 0.9)]},
               "pdserve-colocated@baseline": {"sweep": [point(1.0, 50, 20, 1.0), point(3.0, 100, 10, 0.9)]},
               "vllm": {"sweep": [point(1.0, 200, 40, 1.0), {"request_rate": 3.0, "error": "down"}]}}
    rows = report.baseline_ratios(serving)["pdserve-colocated"]
    assert [r["request_rate"] for r in rows] == [1.0, 3.0]
    assert rows[0]["mean_ttft_ms_over_baseline"] == 2.0 and rows[0]["mean_tpot_ms_over_baseline"] == 0.5
    assert rows[0]["mean_tpot_ms_over_vllm"] == 0.25 and rows[0]["baseline_mean_tpot_ms_over_vllm"] == 0.5
    assert "mean_tpot_ms_over_vllm" not in rows[1]  # vLLM failed at that rate
    assert set(report.baseline_ratios(serving)) == {"pdserve-colocated"}
