"""The Triton attention kernels compile for sm_90 (H100 / H200) on a machine without a GPU,
with Triton's own ptxas, at the configurations the engine launches: the interpreter the
other kernel tests use never compiles them, so a kernel it runs can still fail to build
for the GPU. At an 8B model's bf16 shape no kernel spills registers (a spilling tile
shape is several times slower)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[2]


def test_attention_kernels_compile_for_sm90_without_spills():
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-m", "tests.support.compile_sm90"], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    kernels = {(r["dtype"], r["kernel"]) for r in rows}
    assert kernels == {(dt, k) for dt in ("bfloat16", "float32")
                       for k in ("_paged_prefill_kernel", "_decode_split_kernel", "_decode_merge_kernel")}
    assert all(r["regs"] > 0 for r in rows)
    assert [r for r in rows if r["dtype"] == "bfloat16" and r["stack"]] == []  # the 8B shape spills nothing
