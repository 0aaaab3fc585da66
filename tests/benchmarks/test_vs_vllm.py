"""benchmarks/vs_vllm.py's bookkeeping, without servers: the median over a rate's repeats,
and which servers are up when (`--servers-up one` starts one per rate and stops it after;
`all` starts every server once)."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def vs():
    """The script as a module. It puts benchmarks/ first on sys.path, where a
    kv_transfer.py would shadow the package: the package is imported before, and the
    path and every module loaded from benchmarks/ are put back after."""
    import kv_transfer  # noqa: F401  (the package, before benchmarks/kv_transfer.py can shadow it)
    saved_path, before = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location("vs_vllm_under_test", ROOT / "benchmarks" / "vs_vllm.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses and annotations look their module up
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.path[:] = saved_path
        for name in set(sys.modules) - before:
            if Path(getattr(sys.modules[name], "__file__", None) or "/").parent == ROOT / "benchmarks":
                del sys.modules[name]
        sys.modules.pop(spec.name, None)


def point(rate, ttft, tpot, attain):
    return {"request_rate": rate, "mean_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_tpot_ms": tpot,
            "p99_tpot_ms": 2 * tpot, "slo_attainment": attain, "request_goodput": attain * rate,
            "output_throughput": 60.0}


def test_median_point_is_per_metric_and_skips_failed_points(vs):
    pts = [point(1.0, 300, 20, 1.0), point(1.0, 200, 40, 0.5), {"request_rate": 1.0, "error": "timed out"},
           point(1.0, 250, 10, 0.9)]
    m = vs.median_point(1.0, pts)
    assert (m["mean_ttft_ms"], m["mean_tpot_ms"], m["slo_attainment"], m["repeats"]) == (250, 20, 0.9, 3)
    assert m["request_rate"] == 1.0


def test_median_point_of_failures_names_the_error_and_rate(vs):
    m = vs.median_point(3.0, [{"request_rate": 3.0, "error": "timed out after 600 s"}])
    assert m == {"request_rate": 3.0, "error": "timed out after 600 s"}


class FakeServer:
    def __init__(self, name, log):
        self.name, self.log, self.cmd = name, log, f"cmd {name}"
        log.append(("start", name))

    def stop(self):
        self.log.append(("stop", self.name))


def servers_log(vs, monkeypatch, mode: str) -> list:
    log: list = []
    monkeypatch.setattr(vs, "start_server", lambda name, *a: FakeServer(name, log))
    args = argparse.Namespace(configs="colocated,1p1d", vllm_python="/x/python", servers_up=mode)
    with vs.Servers(args, "model", 100, Path("."), None) as servers:
        for name in vs.server_names(args):
            with servers.serving(name) as (s, others):
                log.append(("measure", s.name, sorted(o.name for o in others)))
    return log


def test_one_server_up_at_a_time(vs, monkeypatch):
    log = servers_log(vs, monkeypatch, "one")
    names = ["pdserve-colocated", "pdserve-1p1d", "vllm"]
    assert log == [e for n in names for e in (("start", n), ("measure", n, []), ("stop", n))]


def test_all_servers_up_through_the_sweep(vs, monkeypatch):
    log = servers_log(vs, monkeypatch, "all")
    names = ["pdserve-colocated", "pdserve-1p1d", "vllm"]
    assert log[:3] == [("start", n) for n in names]
    assert log[3:6] == [("measure", n, sorted(set(names) - {n})) for n in names]
    assert sorted(log[6:]) == sorted(("stop", n) for n in names)



def test_baseline_ratios_divide_this_checkout_by_the_baseline_and_by_vllm(vs):
    serving = {"pdserve-colocated": {"sweep": [point(1.0, 100, 10, 1.0), point(3.0, 200, 20, 0.9)]},
               "pdserve-colocated@baseline": {"sweep": [point(1.0, 50, 20, 1.0), point(3.0, 100, 10, 0.9)]},
               "vllm": {"sweep": [point(1.0, 200, 40, 1.0), {"request_rate": 3.0, "error": "down"}]}}
    rows = vs.baseline_ratios(serving)["pdserve-colocated"]
    assert [r["request_rate"] for r in rows] == [1.0, 3.0]
    assert rows[0]["mean_ttft_ms_over_baseline"] == 2.0 and rows[0]["mean_tpot_ms_over_baseline"] == 0.5
    assert rows[0]["mean_tpot_ms_over_vllm"] == 0.25 and rows[0]["baseline_mean_tpot_ms_over_vllm"] == 0.5
    assert "mean_tpot_ms_over_vllm" not in rows[1]  # vLLM failed at that rate
    assert set(vs.baseline_ratios(serving)) == {"pdserve-colocated"}


def test_baseline_servers_join_the_alternation_only_when_asked(vs):
    args = argparse.Namespace(configs="colocated,1p1d", baseline=None, vllm_python="/v/bin/python")
    assert vs.server_names(args) == ["pdserve-colocated", "pdserve-1p1d", "vllm"]
    args.baseline = "/tmp/old"
    assert vs.server_names(args) == ["pdserve-colocated", "pdserve-1p1d", "pdserve-colocated@baseline",
                                     "pdserve-1p1d@baseline", "vllm"]


def test_offline_runs_both_engines_at_the_asked_dtype(vs, monkeypatch, tmp_path):
    """--dtype reaches pdserve's child (its --dtype) and vLLM's workload file ("dtype")."""
    import json
    import subprocess

    seen: dict = {}

    def fake_run(cmd, stdout=None, stderr=None, env=None):
        out = Path(cmd[cmd.index("--child-out") + 1] if "--child-out" in cmd else cmd[-1])
        if "--child-out" in cmd:
            seen["pdserve"] = cmd[cmd.index("--dtype") + 1]
        else:
            seen["vllm"] = json.loads(Path(cmd[-2]).read_text())["dtype"]
        out.write_text(json.dumps({"output_tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vs.subprocess, "run", fake_run)
    monkeypatch.setattr(vs, "vllm_env", lambda python: {})
    (tmp_path / "logs").mkdir()
    args = argparse.Namespace(offline_prompts=2, offline_repeats=1, vllm_python="/x/python", out_dir=str(tmp_path),
                              dtype="bfloat16")
    report = vs.offline(args, "model", 100, tmp_path)
    assert seen == {"pdserve": "bfloat16", "vllm": "bfloat16"}
    assert report["workload"]["dtype"] == "bfloat16" and report["ratio_pdserve_over_vllm"] == 1.0
