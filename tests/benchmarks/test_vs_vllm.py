"""benchmarks/vs_vllm.py's bookkeeping, without servers: which servers are up when
(`--servers-up one` starts one per rate and stops it after; `all` starts every server once),
which servers a `--baseline` run adds, and the dtype the offline runs are given."""
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
    from pdserve import kv_transfer  # noqa: F401  (the package, before benchmarks/kv_transfer.py can shadow it)

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
