"""benchmarks/planner_targets.py's verdicts, without servers: each system's goodput rate
per regime, the planner's against the best fixed split and vLLM, and a sweep that says
nothing (every system misses at the lowest rate) reported as undecided, not as met."""
from __future__ import annotations

import pytest

from tests.support.bench_scripts import script

TTFT_BOUND, TPOT_BOUND = "ttft1000_tpot100", "ttft2000_tpot15"


@pytest.fixture(scope="module")
def pt():
    with script("planner_targets") as module:
        yield module


def points(*attain: dict[str, float], rates=(1.0, 2.0, 3.0)) -> list[dict]:
    return [{"request_rate": r, "by_regime": {k: {"slo_attainment": v} for k, v in a.items()}}
            for r, a in zip(rates, attain)]


def test_planner_against_best_fixed_and_vllm(pt):
    both = (TTFT_BOUND, TPOT_BOUND)
    run = {
        "colocated": points(*({r: a for r in both} for a in (1.0, 1.0, 0.5))),      # 2 + 0.1/0.5 = 2.2
        "1p1d": points(*({r: a for r in both} for a in (0.95, 0.7, 0.0))),          # 1 + 0.05/0.25 = 1.2
        f"planner-{TTFT_BOUND}": points({TTFT_BOUND: 1.0}, {TTFT_BOUND: 1.0}, {TTFT_BOUND: 0.7}),  # 2 + 0.1/0.3
        f"planner-{TPOT_BOUND}": points({TPOT_BOUND: 0.5}, {TPOT_BOUND: 0.5}, {TPOT_BOUND: 0.5}),  # none
        "vllm": points(*({r: a for r in both} for a in (0.9, 0.5, 0.0))),           # 1.0
    }
    out = pt.report(run, list(both))
    ttft = out[TTFT_BOUND]
    assert ttft["goodput_knee"]["colocated"]["rate"] == pytest.approx(2.2)
    assert ttft["best_fixed"]["rate"] == pytest.approx(2.2)
    assert ttft["planner_over_best_fixed"] == pytest.approx((7 / 3) / 2.2)
    assert ttft["planner_over_vllm"] == pytest.approx(7 / 3)
    assert ttft["met"] == {"0.9x best fixed": True, ">= vllm": True}
    tpot = out[TPOT_BOUND]
    assert tpot["goodput_knee"][f"planner-{TPOT_BOUND}"]["censored"] == "below"
    assert tpot["met"] == {"0.9x best fixed": False, ">= vllm": False}


def test_a_sweep_where_everything_misses_at_its_lowest_rate_is_undecided(pt):
    miss = points({TPOT_BOUND: 0.2}, {TPOT_BOUND: 0.0})
    out = pt.report({"colocated": miss, "1p1d": miss, f"planner-{TPOT_BOUND}": miss}, [TPOT_BOUND])
    assert out[TPOT_BOUND]["met"] == {"0.9x best fixed": None, ">= vllm": None}
    assert out[TPOT_BOUND]["planner_over_best_fixed"] is None


def test_a_later_run_adds_its_rates_and_replaces_the_same_rate(pt):
    earlier = {"colocated": points({TTFT_BOUND: 1.0}, {TTFT_BOUND: 0.5}), "vllm": points({TTFT_BOUND: 0.9})}
    later = {"colocated": points({TTFT_BOUND: 0.95}, {TTFT_BOUND: 0.2}, rates=(2.0, 4.0)),
             "planner-" + TTFT_BOUND: points({TTFT_BOUND: 1.0}, rates=(4.0,))}
    both = pt.merged(earlier, later)
    assert [(p["request_rate"], p["by_regime"][TTFT_BOUND]["slo_attainment"]) for p in both["colocated"]] == \
        [(1.0, 1.0), (2.0, 0.95), (4.0, 0.2)]
    assert both["vllm"] == earlier["vllm"] and both["planner-" + TTFT_BOUND] == later["planner-" + TTFT_BOUND]
    assert pt.report(both, [TTFT_BOUND])[TTFT_BOUND]["goodput_knee"]["colocated"]["rate"] == pytest.approx(2.0 + 2 * 0.05 / 0.75)


def test_two_systems_that_never_miss_are_not_compared_as_knees(pt):
    """Both at the top of the sweep: not "planner = best fixed, 1.00x" but undecided."""
    never = points(*({TTFT_BOUND: a} for a in (1.0, 1.0, 0.95)))
    out = pt.report({"colocated": never, "1p1d": never, f"planner-{TTFT_BOUND}": never}, [TTFT_BOUND])[TTFT_BOUND]
    assert out["goodput_knee"]["colocated"]["censored"] == "above" and out["best_fixed"] is None
    assert out["planner_over_best_fixed"] is None and out["met"]["0.9x best fixed"] is None


def test_interleaved_runs_each_rate_on_every_system_and_stops_every_server(pt, monkeypatch):
    """Rate by rate, the system order reversed at every other rate; every server stopped,
    also when a point fails."""
    calls, stopped = [], []

    class Fake:
        def __init__(self, name):
            self.name, self.cmd = name, f"serve {name}"

        def stop(self):
            stopped.append(self.name)

    monkeypatch.setattr(pt, "start", lambda name, *a: Fake(name))
    monkeypatch.setattr(pt, "point", lambda s, name, args, rate, k, *a: calls.append((rate, name)) or {"rate": rate})
    runs = pt.interleaved(["a", "b", "c"], None, [0.5, 1.0, 2.0], 100, None, [])
    assert calls == [(0.5, "a"), (0.5, "b"), (0.5, "c"), (1.0, "c"), (1.0, "b"), (1.0, "a"),
                     (2.0, "a"), (2.0, "b"), (2.0, "c")]
    assert runs["b"] == {"command": "serve b", "points": [{"rate": 0.5}, {"rate": 1.0}, {"rate": 2.0}]}
    assert sorted(stopped) == ["a", "b", "c"]

    stopped.clear()

    def fail(s, name, args, rate, k, *a):
        raise RuntimeError(f"{name} at {rate}")

    monkeypatch.setattr(pt, "point", fail)
    with pytest.raises(RuntimeError, match="a at 0.5"):
        pt.interleaved(["a", "b"], None, [0.5], 100, None, [])
    assert sorted(stopped) == ["a", "b"]


def test_cpu_split_counts_the_server_and_its_workers_apart(pt):
    """A worker alive throughout counts its delta, one started in between counts from 0,
    one that exited in between is counted as exited (its CPU is lost)."""
    before = {10: 5.0, 11: 100.0, 12: 40.0}
    after = {10: 6.5, 11: 130.0, 13: 2.0}
    assert pt.cpu_split(10, before, after) == {"root_s": 1.5, "descendants_s": 32.0, "exited": 1}
