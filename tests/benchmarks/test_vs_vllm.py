"""benchmarks/offline/vs_vllm.py's bookkeeping, without running an engine: both engines get
the asked dtype, and they take turns, the order reversed at every repeat."""
from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from tests.support.bench_scripts import script

vs = script("offline.vs_vllm")


def test_offline_runs_both_engines_at_the_asked_dtype_taking_turns(monkeypatch, tmp_path):
    """--dtype reaches pdserve's child (its --dtype) and vLLM's workload file ("dtype")."""
    seen: list = []

    def fake_run(cmd, stdout=None, stderr=None, env=None, cwd=None):
        out = Path(cmd[cmd.index("--child-out") + 1] if "--child-out" in cmd else cmd[-1])
        if "--child-out" in cmd:
            seen.append(("pdserve", cmd[cmd.index("--dtype") + 1]))
        else:
            seen.append(("vllm", json.loads(Path(cmd[-2]).read_text())["dtype"]))
        out.write_text(json.dumps({"output_tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0}))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(vs.subprocess, "run", fake_run)
    monkeypatch.setattr(vs, "vllm_env", lambda python: {})
    (tmp_path / "logs").mkdir()
    args = argparse.Namespace(offline_prompts=2, offline_repeats=2, vllm_python="/x/python", out_dir=str(tmp_path),
                              dtype="bfloat16")
    report = vs.offline(args, "model", 100, tmp_path)
    assert seen == [("pdserve", "bfloat16"), ("vllm", "bfloat16"), ("vllm", "bfloat16"), ("pdserve", "bfloat16")]
    assert report["workload"]["dtype"] == "bfloat16" and report["ratio_pdserve_over_vllm"] == 1.0
