"""What a benchmark's JSON report says about its run, and how the report is written."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
              "avx_vnni", "amx_bf16", "amx_int8")  # the ones the kernels' speed depends on


def cpu_facts() -> dict:
    """The CPU's model name and which of SIMD_FLAGS it has (from /proc/cpuinfo; empty off Linux)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    first = {ln.split(":")[0].strip(): ln.split(":", 1)[1].strip() for ln in reversed(lines) if ":" in ln}
    flags = set(first.get("flags", "").split())
    return {"model": first.get("model name", platform.processor()), "simd": [f for f in SIMD_FLAGS if f in flags]}


def run_facts() -> dict:
    """When, how (the command line) and where (CPU model and SIMD flags, platform, load
    average) it ran."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host": {"cpus": os.cpu_count(), "cpu": cpu_facts(), "platform": platform.platform(),
                     "loadavg": os.getloadavg()}}


def write_report(report: dict, out: str | Path) -> Path:
    """`report` as indented JSON at `out` (its folder made), announced on stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path
