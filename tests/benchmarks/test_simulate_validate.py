"""benchmarks/slo/simulate_validate.py's per-request agreement, without servers: which
requests missed a TPOT SLO in a simulated (or repeated) run, in the first served run,
and in both -- counted by position, None (a one-token output) never a miss."""
from __future__ import annotations

import pytest

from tests.support.bench_scripts import script


@pytest.fixture(scope="module")
def sv():
    yield script("slo.simulate_validate")


def fig(*tpot_ms: float | None) -> dict:
    return {"per_request": {"tpot_s": [None if t is None else t / 1000 for t in tpot_ms]}}


def test_counts_the_misses_of_each_run_and_the_requests_both_share(sv):
    assert [t for _, t in sv.SLOS] == [100.0, 15.0]
    sim = fig(10, 250, 12, 16, None, 400)
    meas = fig(11, 300, 120, 14, 900, 9)
    assert sv.over_tpot_slo(sim, meas) == {
        "tpot100": {"this": 2, "measured": 3, "both": 1},   # 1, 5 against 1, 2, 4
        "tpot15": {"this": 3, "measured": 3, "both": 1},    # 1, 3, 5 against 1, 2, 4
    }


def test_a_run_against_itself_agrees_everywhere(sv):
    meas = fig(8, 20, 200, None)
    assert all(v == {"this": n, "measured": n, "both": n}
               for v, n in zip(sv.over_tpot_slo(meas, meas).values(), (1, 2)))
