"""What a benchmark's report says about its run: when, the command, the code (commit, and
whether the tree had uncommitted changes), the chip (model, SIMD flags, caches, nominal
memory bandwidth where known), the threads, and how busy the machine was."""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import psutil

from benchmarks.harness.paths import REPO

SIMD_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni",
              "avx_vnni", "amx_bf16", "amx_int8")  # the ones the kernels' speed depends on


def cpu_facts() -> dict:
    """The CPU's model name, which of SIMD_FLAGS it has (from /proc/cpuinfo; empty off Linux)
    and its cache sizes (bytes, from sysfs)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return {}
    first = {ln.split(":")[0].strip(): ln.split(":", 1)[1].strip() for ln in reversed(lines) if ":" in ln}
    flags = set(first.get("flags", "").split())
    return {"model": first.get("model name", platform.processor()), "simd": [f for f in SIMD_FLAGS if f in flags],
            "caches": cache_sizes()}


def cache_sizes() -> dict[str, int]:
    """Each cache level's size in bytes as cpu0 sees it (L1d, L2, L3), from sysfs."""
    out: dict[str, int] = {}
    for idx in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            kind = (idx / "type").read_text().strip()
            level = (idx / "level").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        if kind == "Instruction":
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1], 1)
        out[f"L{level}{'d' if kind == 'Data' else ''}"] = int(size.rstrip("KMG")) * mult
    return out


def last_level_cache_bytes() -> int | None:
    """The largest cache's size (the LLC, shared by the cores that cpu0's is), or None."""
    sizes = cache_sizes()
    return max(sizes.values()) if sizes else None


def best_bf16_dtype() -> str:
    """vLLM's best dtype for this CPU: bfloat16 where it has AVX512_BF16 or AMX (its fast bf16
    paths), float32 otherwise (on AVX2 its bf16 is a slow emulated path)."""
    simd = set(cpu_facts().get("simd", []))
    return "bfloat16" if {"avx512_bf16", "amx_bf16"} & simd else "float32"


def code_facts(repo: Path = REPO) -> dict:
    """The commit the run's code is at and whether the tree differs from it."""
    def git(*a: str) -> str:
        done = subprocess.run(["git", "-C", str(repo), *a], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    return {"commit": git("rev-parse", "--short=12", "HEAD") or None,
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine_load(sample_s: float = 0.5, top: int = 5) -> dict:
    """How busy the machine is now: load averages, runnable tasks, and the busiest processes
    outside this process tree over `sample_s` (CPU share of one core each)."""
    own = {psutil.Process().pid, *(c.pid for c in psutil.Process().children(recursive=True))}
    procs = [p for p in psutil.process_iter(["pid", "name"]) if p.pid not in own]
    for p in procs:
        try:
            p.cpu_percent(None)
        except psutil.Error:
            pass
    time.sleep(sample_s)
    busy = []
    for p in procs:
        try:
            pct = p.cpu_percent(None)
            if pct >= 10.0:
                busy.append({"pid": p.pid, "name": p.info["name"], "cpu_percent": round(pct, 1),
                             "cmd": " ".join(p.cmdline())[:120]})
        except psutil.Error:
            pass
    busy.sort(key=lambda b: -b["cpu_percent"])
    try:
        running = int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        running = None
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "runnable_tasks": running,
            "busy_other_processes": len(busy), "busiest": busy[:top]}


def command_line() -> str:
    """This process's command as typed: `python -m benchmarks.x.y ...` for a module run with -m."""
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    head = ["python", "-m", spec.name.removesuffix(".__main__")] if spec and spec.name else \
        [Path(sys.executable).name, sys.argv[0]]
    return " ".join([*head, *sys.argv[1:]])


def run_facts(threads: int | None = None) -> dict:
    """When, how (the command line), which code and where (CPU model, SIMD flags, caches,
    platform, load) it ran; `threads`: the torch threads the measured engine used."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": command_line(),
            "code": code_facts(), "threads": threads,
            "host": {"cpus": os.cpu_count(), "cpu": cpu_facts(), "platform": platform.platform(),
                     "loadavg": os.getloadavg()}}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, since boot)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def own_tree_cpu_s() -> float:
    """CPU seconds of this process and its live descendants (a benchmark, its servers)."""
    total = 0.0
    me = psutil.Process()
    for p in [me, *me.children(recursive=True)]:
        try:
            t = p.cpu_times()
            total += t.user + t.system + t.children_user + t.children_system
        except psutil.Error:
            pass
    return total
