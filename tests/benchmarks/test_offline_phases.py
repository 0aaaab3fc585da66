"""benchmarks/offline/phases.py on a tiny model: every output token is one decode step's or
a prefill's, and the phases' seconds fit in the wall time."""
from __future__ import annotations

import json

import pytest

from tests.support.bench_scripts import script


@pytest.fixture(scope="module")
def offline_phases():
    yield script("offline.phases")


def test_a_run_splits_each_dtype_into_prefill_and_decode_steps(offline_phases, model_dirs, tmp_path):
    out = tmp_path / "phases.json"
    assert offline_phases.main(["--model", model_dirs["qwen3"], "--num-prompts", "2", "--rounds", "1", "--threads", "1",
                                "--dtype", "float32,bfloat16", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    for dt in ("float32", "bfloat16"):
        (run,) = report["rounds"][dt]
        assert 0 < run["prefill_s"] and 0 < run["decode_s"] and run["prefill_s"] + run["decode_s"] <= run["wall_s"]
        steps = run["decode_by_rows"]
        # each decode step gives one token per row; each prompt's first token comes from its prefill
        tokens = sum(int(rows) * len(times) for rows, times in steps.items())
        assert tokens == report["total_output_tokens"] - 2
        assert set(report["by_dtype"][dt]["decode_rows"]) == set(steps)
