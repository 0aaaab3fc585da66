"""benchmarks/slo/planner_heldout.py's guards and traffic, without servers: an evaluation that
shares rows or seeds with the tuning is refused, an uncommitted frozen file is not frozen,
a trace window replays at the asked rate with fresh prompts per point, and tuning picks the
candidate that met the SLOs most."""
from __future__ import annotations

import argparse
import subprocess

import pytest

from tests.support.bench_scripts import script

ho = script("slo.planner_heldout")


def test_windows_parse_and_overlap_is_found():
    assert ho.parse_windows("0:0,1500:1") == [(0, 0), (1500, 1)]
    tune = ho.window_facts(ho.SYNTHETIC, [(0, 0), (1500, 1)], 100)
    assert ho.overlap(tune, ho.window_facts(ho.CONVERSATION, [(3000, 100)], 100)) == []
    assert ho.overlap(tune, ho.window_facts(ho.CONVERSATION, [(0, 0)], 100)) == ["seeds [0] were the tuning's"]
    same = ho.overlap(tune, ho.window_facts(ho.SYNTHETIC, [(1550, 7)], 100))
    assert same == ["rows [1550, 1650] overlap the tuning's [1500, 1600] of the same trace"]
    assert ho.overlap(tune, ho.window_facts(ho.SYNTHETIC, [(1600, 7)], 100)) == []  # adjacent, not shared


def test_a_file_is_frozen_only_once_committed_and_unchanged(tmp_path, monkeypatch):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.email=t@t", "-c", "user.name=t"]
    subprocess.run([*git, "init", "-q"], check=True)
    monkeypatch.setattr(ho, "REPO", repo)
    f = repo / "frozen.json"
    f.write_text("{}")
    assert ho.frozen_state(f) == {"frozen": False, "why": "frozen.json is not committed"}
    subprocess.run([*git, "add", "frozen.json"], check=True)
    subprocess.run([*git, "commit", "-qm", "freeze"], check=True)
    state = ho.frozen_state(f)
    assert state["frozen"] and state["file"] == "frozen.json" and len(state["commit"]) == 40
    f.write_text('{"changed": 1}')
    assert ho.frozen_state(f) == {"frozen": False, "why": "frozen.json has uncommitted changes"}


def test_a_trace_window_replays_at_the_rate_with_fresh_prompts_per_point():
    args = argparse.Namespace(max_output=64, max_input=768)
    load = ho.trace_load(ho.CONVERSATION, 3000, 100, args, vocab=1000)
    reqs, times = load(0, 2.0, 50)
    assert len(reqs) == len(times) == 50 and times[0] == 0.0
    assert len(times) / times[-1] == pytest.approx(2.0, rel=0.05)  # the mean rate asked (ties spread)
    assert all(a <= b for a, b in zip(times, times[1:]))
    assert all(r.prompt_len <= 768 and 1 <= r.output_len <= 64 for r in reqs)
    again, _ = load(1, 2.0, 50)
    assert [r.prompt_len for r in again] == [r.prompt_len for r in reqs]  # the same rows...
    assert again[0].prompt_token_ids != reqs[0].prompt_token_ids  # ...with other tokens: no cache across points


def test_tuning_picks_the_candidate_that_met_the_slos_most():
    def pts(a):
        return [{"by_regime": {"r": {"slo_attainment": a}}}]
    report = {"points": {"pdserve-planner-r-fast@float32": pts(0.9), "pdserve-planner-r-slow@float32": pts(0.6),
                         "pdserve-colocated@float32": pts(1.0)}}
    choice = ho.pick(report, [{"name": "fast", "flags": {"planner_sustain": 2}}, {"name": "slow", "flags": {}}])
    assert choice == {"scores": {"fast": 0.9, "slow": 0.6}, "chosen": "fast", "flags": {"planner_sustain": 2},
                      "latency_models": False}
    report["points"]["pdserve-planner-r-models@float32"] = pts(0.95)
    choice = ho.pick(report, [{"name": "fast", "flags": {}}, {"name": "models", "flags": {}, "latency_models": True}])
    assert choice["chosen"] == "models" and choice["latency_models"] is True


def test_a_models_candidate_is_served_with_this_machines_profiles(tmp_path, monkeypatch):
    """`latency_models`: `pdserve profile` at the host's cores and half of them, float32 and
    unquantized as served, and the planner flag naming both files; a failed profile stops the run."""
    ran = []

    def fake_run(cmd, **kw):
        ran.append(cmd)
        out = cmd[cmd.index("--out") + 1]
        with open(out, "w") as f:
            f.write('{"meta": {"num_threads": %s}}' % cmd[cmd.index("--num-threads") + 1])
        return subprocess.CompletedProcess(cmd, 0, "", "")
    monkeypatch.setattr(ho.subprocess, "run", fake_run)
    monkeypatch.setattr(ho.os, "cpu_count", lambda: 4)
    report: dict = {}
    models = ho.profile_models("/m", tmp_path, report)
    assert [c[c.index("--num-threads") + 1] for c in ran] == ["4", "2"]
    assert all(c[2:5] == ["pdserve", "profile", "/m"] and "float32" in c and "none" in c for c in ran)
    assert models == f"{tmp_path}/latency_model_t4.json,{tmp_path}/latency_model_t2.json"
    assert [m["model"]["meta"]["num_threads"] for m in report["latency_models"]] == [4, 2]
    assert dict(ho.candidate_flags({"flags": {"planner_sustain": 2}, "latency_models": True}, models)) == \
        {"planner_sustain": "2", "planner_latency_models": models}
    assert dict(ho.candidate_flags({"flags": {"planner_sustain": 2}}, models)) == {"planner_sustain": "2"}
    monkeypatch.setattr(ho.subprocess, "run", lambda cmd, **kw: subprocess.CompletedProcess(cmd, 1, "", "boom"))
    with pytest.raises(SystemExit, match="boom"):
        ho.profile_models("/m", tmp_path, {})
