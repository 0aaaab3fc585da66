"""benchmarks/compare, without servers: regimes derived from the slower system's unloaded
latency (never below it), points judged per regime (a planner only under its own), knees
censored where a sweep does not bracket them, the systems interleaved rate by rate, and the
README table made from the JSON alone."""
from __future__ import annotations

import argparse

import pytest

from pdserve.router.stats.intervals import wilson_interval
from pdserve.router.stats.latency import RequestRecord
from tests.support.bench_scripts import script

regimes_mod = script("compare.regimes")
judge = script("compare.judge")
run = script("compare.run")
systems = script("compare.systems")
sweep = script("compare.sweep")
table = script("compare.table")

UNLOADED = {"vllm@float32": {"ttft_ms": 80.0, "tpot_ms": 15.0}, "pdserve-colocated@float32": {"ttft_ms": 60.0,
                                                                                               "tpot_ms": 9.0}}


def test_regimes_are_multiples_of_the_slower_systems_unloaded_latency():
    rules = regimes_mod.parse_rules("ttft_bound=3:10,tpot_bound=10:2")
    r = regimes_mod.derive(UNLOADED, rules)
    assert r["ttft_bound"]["ttft_ms"] == 240.0 and r["ttft_bound"]["tpot_ms"] == 150.0  # 3 x 80, 10 x 15
    assert r["tpot_bound"]["ttft_ms"] == 800.0 and r["tpot_bound"]["tpot_ms"] == 30.0  # 10 x 80, 2 x 15
    assert r["tpot_bound"]["slower_unloaded"]["tpot_of"] == "vllm@float32"
    for regime in r.values():  # no regime rules a system out by construction
        assert all(regime["ttft_ms"] >= u["ttft_ms"] and regime["tpot_ms"] >= u["tpot_ms"] for u in UNLOADED.values())


def test_a_rule_below_the_unloaded_latency_is_refused():
    with pytest.raises(ValueError, match="kernel speed"):
        regimes_mod.parse_rules("tight=3:0.8")
    with pytest.raises(ValueError):
        regimes_mod.parse_rules("nonsense")


def _rec(ttft_s: float, tpot_s: float, n: int = 5) -> RequestRecord:
    return RequestRecord(0.0, [ttft_s + k * tpot_s for k in range(n)], 10)


def test_attainment_under_a_regime_counts_both_slos_and_failures():
    regime = {"ttft_ms": 100.0, "tpot_ms": 20.0}
    recs = [_rec(0.05, 0.01), _rec(0.05, 0.03), _rec(0.2, 0.01), RequestRecord(0.0, [], 10, success=False)]
    a = judge.attainment_under(recs, regime, duration_s=2.0)
    assert (a["slo_met"], a["slo_requests"], a["slo_attainment"]) == (1, 4, 0.25)
    assert a["slo_attainment_ci95"] == pytest.approx(list(wilson_interval(1, 4)))
    assert a["request_goodput"] == 0.5


def test_knees_per_regime_leave_a_planner_out_of_the_other_regime():
    def pts(att_by_regime):
        return [{"request_rate": r, "by_regime": {k: {"slo_attainment": a, "slo_attainment_ci95": [a, a]}
                                                  for k, a in regs.items()}}
                for r, regs in att_by_regime]
    points = {"fixed": pts([(1, {"a": 1.0, "b": 1.0}), (2, {"a": 0.5, "b": 0.95})]),
              "planner-a": pts([(1, {"a": 1.0}), (2, {"a": 0.95})])}
    k = judge.knees(points, {"a": {}, "b": {}})
    assert k["a"]["fixed"]["rate"] == pytest.approx(1 + 0.1 / 0.5) and k["a"]["fixed"]["censored"] is None
    assert k["b"]["fixed"]["censored"] == "above" and k["a"]["planner-a"]["censored"] == "above"
    assert "planner-a" not in k["b"]


def test_systems_per_dtype_and_planners_per_regime():
    fixed = systems.fixed_systems(["vllm", "colocated", "1p1d", "planner"], ["bfloat16", "float32"])
    assert [s.name for s in fixed] == ["vllm@bfloat16", "pdserve-colocated@bfloat16", "pdserve-1p1d@bfloat16",
                                       "vllm@float32", "pdserve-colocated@float32", "pdserve-1p1d@float32"]
    planners = systems.planner_systems(["planner"], ["float32"], ["ttft_bound", "tpot_bound"])
    assert [(s.name, s.regime) for s in planners] == [("pdserve-planner-ttft_bound@float32", "ttft_bound"),
                                                      ("pdserve-planner-tpot_bound@float32", "tpot_bound")]
    flags = systems.planner_flags({"ttft_ms": 240.0, "tpot_ms": 30.0}, {"planner_interval_s": 3})
    assert flags[:6] == ["--planner", "slo", "--slo-ttft-ms", "240.0", "--slo-tpot-ms", "30.0"]
    assert flags[-2:] == ["--planner-interval-s", "3"]


class FakeServer:
    def __init__(self, name):
        self.name, self.cmd, self.url, self.ps = name, f"serve {name}", "http://x/v1", None
        self.stopped = False

    def stop(self):
        self.stopped = True


def test_a_run_measures_unloaded_first_then_interleaves_every_rate(monkeypatch, tmp_path):
    calls: list = []
    started: dict = {}

    def fake_start(system, args, vocab, logdir, regimes):
        calls.append(("start", system.name, dict(regimes)))
        started[system.name] = FakeServer(system.name)
        return started[system.name]

    def fake_unloaded(server, args, vocab):
        calls.append(("unloaded", server.name))
        return {"ttft_ms": 50.0, "tpot_ms": 10.0} if "vllm" in server.name else {"ttft_ms": 40.0, "tpot_ms": 5.0}

    def fake_point(s, system, args, rate, k, load, regimes, others):
        calls.append(("point", system.name, rate))
        recs = [_rec(0.05, 0.005)] * 10
        own = [system.regime] if system.regime else list(regimes)
        return {"request_rate": rate, "duration": 1.0,
                "by_regime": {r: judge.attainment_under(recs, regimes[r], 1.0) for r in own}}, recs

    monkeypatch.setattr(systems, "start", fake_start)
    monkeypatch.setattr(systems, "unloaded", fake_unloaded)
    monkeypatch.setattr(sweep, "point", fake_point)
    monkeypatch.setattr(run, "vllm_version", lambda python: "0.0")
    monkeypatch.setattr(run, "best_bf16_dtype", lambda: "float32")
    monkeypatch.setattr(run, "freeze_startup_heap", lambda: 0)  # the load generator's; not this test process's heap
    for module in (run, sweep):
        monkeypatch.setattr(module, "machine_load", lambda **kw: {"loadavg": [0.0], "busy_other_processes": 0})
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text('{"vocab_size": 100}')
    monkeypatch.setattr(run.ModelConfig, "from_dir", lambda d: argparse.Namespace(vocab_size=100))
    out = tmp_path / "c.json"
    assert run.main(["--vllm-python", "/x/python", "--model", str(model), "--rates", "1,2", "--num-prompts", "10",
                     "--out", str(out)]) == 0
    kinds = [c[0] for c in calls]
    assert kinds[:6] == ["start", "unloaded"] * 3  # every fixed system's unloaded latency first
    assert all(c[2] == {} for c in calls[:6] if c[0] == "start")  # no regime known yet
    planner_starts = [c for c in calls if c[0] == "start" and "planner" in c[1]]
    assert len(planner_starts) == 2 and all(c[2] for c in planner_starts)  # started with the derived regimes
    order = [(c[1], c[2]) for c in calls if c[0] == "point"]
    names = [n for n, r in order if r == 1.0]
    assert [n for n, r in order if r == 2.0] == names[::-1]  # the order reversed at the next rate
    assert len(names) == 5 and all(s.stopped for s in started.values())
    import json
    report = json.loads(out.read_text())
    assert report["regimes"]["ttft_bound"]["ttft_ms"] == 150.0  # 3 x vLLM's 50 ms, the slower
    assert report["knees"]["ttft_bound"]["vllm@float32"]["censored"] == "above"
    assert set(report["unloaded"]) == set(report["systems"])
    assert "planner" in table.render(report, "c.json")


def test_the_table_says_censored_knees_and_their_interval_ends():
    knee = {"rate": 2.0, "censored": "above", "interval_ends": {"from_lower": {"rate": 1.5, "censored": None},
                                                                "from_upper": {"rate": 2.0, "censored": "above"}}}
    assert table.knee_text(knee) == ">= 2.00 (1.50 to >= 2.00)"
    assert table.knee_text({"rate": 1.0, "censored": "below"}) == "< 1.00"
    assert table.knee_text(None) == "-"
    pts = [{"request_rate": 0.5, "by_regime": {"r": {"slo_attainment": 0.65, "slo_attainment_ci95": [0.55, 0.74]}}},
           {"request_rate": 1.0, "by_regime": {}}]
    assert table.attainment_text(pts, "r") == "0.5: 65% (55%-74%)" and table.attainment_text(pts, "x") == "-"
