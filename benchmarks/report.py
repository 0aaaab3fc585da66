"""What a benchmark's JSON report says about its run, and how the report is written."""
from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path


def run_facts() -> dict:
    """When, how (the command line) and where (CPUs, platform, load average) it ran."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg": os.getloadavg()}}


def write_report(report: dict, out: str | Path) -> Path:
    """`report` as indented JSON at `out` (its folder made), announced on stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    return path
