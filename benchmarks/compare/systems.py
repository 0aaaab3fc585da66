"""The systems of a comparison and bringing them up: each a server (vLLM's, or pdserve in a
layout, a planner with its regime's SLOs), warmed up, its unloaded latency measured; the
regimes derived from the fixed systems' before the planners start; the loads they are sent."""
from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.compare.regimes import derive
from benchmarks.harness.servers import Server, log, start_pdserve, start_vllm
from pdserve.router.bench.arrivals import arrival_times
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import BenchRequest, random_workload
from pdserve.router.stats.latency import RequestRecord, summarize

POINT_TIMEOUT_S = 900.0
WARMUP_SEED, UNLOADED_SEED, POINT_SEED = 99, 7_000, 100  # prompt seeds no two uses share


@dataclass(frozen=True)
class System:
    """One served system of the comparison: its engine, layout, dtype and (planner) regime."""

    name: str
    engine: str  # "vllm" | "pdserve"
    layout: str  # "vllm" | "colocated" | "1p1d" | "planner"
    dtype: str
    regime: str | None = None  # the planner's regime (its SLOs); None: judged under every regime
    planner: tuple[tuple[str, str], ...] = ()  # the planner's settings (flag name, value); () : the run's


# A load: (seed, rate, n) -> n requests and their send times (s) at `rate`; the same seed, the
# same requests and times for every system.
Load = Callable[[int, float, int], tuple[list[BenchRequest], list[float]]]


def random_load(input_len: int, output_len: int, vocab: int) -> Load:
    """Random token-id prompts of exactly `input_len` tokens, `output_len` out, Poisson arrivals."""
    def load(seed: int, rate: float, n: int) -> tuple[list[BenchRequest], list[float]]:
        return (random_workload(n, input_len, output_len, 0.0, vocab, seed=POINT_SEED + seed),
                arrival_times(n, rate, 1.0, seed=seed))
    return load


def fixed_systems(layouts: list[str], dtypes: list[str]) -> list[System]:
    """The systems that do not depend on an SLO, per dtype."""
    out = []
    for d in dtypes:
        if "vllm" in layouts:
            out.append(System(f"vllm@{d}", "vllm", "vllm", d))
        out += [System(f"pdserve-{lay}@{d}", "pdserve", lay, d) for lay in ("colocated", "1p1d") if lay in layouts]
    return out


def planner_systems(layouts: list[str], dtypes: list[str], regimes: list[str]) -> list[System]:
    if "planner" not in layouts:
        return []
    return [System(f"pdserve-planner-{r}@{d}", "pdserve", "planner", d, r) for d in dtypes for r in regimes]


def planner_flags(regime: dict, config: dict) -> list[str]:
    """`serve` flags of a planner with the regime's SLOs on this host's cores; `config`: more
    planner flags (a frozen planner file's `flags`), else pdserve's shipped defaults."""
    flags = ["--planner", "slo", "--slo-ttft-ms", str(regime["ttft_ms"]), "--slo-tpot-ms", str(regime["tpot_ms"]),
             "--planner-host-cores", str(os.cpu_count() or 2)]
    for key, value in config.items():
        flags += [f"--{key.replace('_', '-')}", str(value)]
    return flags


def serve(server: Server, reqs: list[BenchRequest], times: list[float]) -> tuple[list[RequestRecord], float]:
    """(records, duration) of the requests sent at their times (greedy, ignore_eos, HTTP)."""
    coro = run_workload(reqs, "http", server.url, times, None, 0.0, True, False, (), False)
    return asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))


def start(system: System, args: argparse.Namespace, vocab: int, logdir: Path, regimes: dict) -> Server:
    """`system`'s server, warmed up with two requests (not counted), given 3 s to settle."""
    if system.engine == "vllm":
        s = start_vllm(args.vllm_python, args.model, logdir, dtype=system.dtype, name=system.name)
    else:
        extra = ["--quantization", "none"]
        if system.layout == "planner":
            extra += planner_flags(regimes[system.regime], dict(system.planner) or args.planner_flags)
        layout = "colocated" if system.layout == "planner" else system.layout
        s = start_pdserve(layout, args.model, logdir, extra, name=system.name, dtype=system.dtype)
    try:
        warm = random_workload(2, args.input_len, args.output_len, 0.0, vocab, seed=WARMUP_SEED)
        recs, _ = serve(s, warm, [0.0, 0.0])
        if not all(r.success for r in recs):
            raise RuntimeError(f"{s.name}: warm-up failed: {[r.error for r in recs]}")
        time.sleep(3.0)
    except BaseException:
        s.stop()
        raise
    return s


def unloaded(server: Server, args: argparse.Namespace, vocab: int) -> dict:
    """Median TTFT and TPOT of requests sent one at a time (bootstrap 95% intervals)."""
    n = args.unloaded_requests
    reqs = random_workload(n, args.input_len, args.output_len, 0.0, vocab, seed=UNLOADED_SEED)
    coro = run_workload(reqs, "http", server.url, [0.0] * n, 1, 0.0, True, False, (), False)
    records, duration = asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))
    if not all(r.success for r in records):
        raise RuntimeError(f"{server.name}: unloaded requests failed: {[r.error for r in records if not r.success]}")
    s = summarize(records, duration)
    return {"ttft_ms": s["median_ttft_ms"], "ttft_ms_ci95": s["median_ttft_ms_ci95"],
            "tpot_ms": s["median_tpot_ms"], "tpot_ms_ci95": s["median_tpot_ms_ci95"], "requests": n,
            "how": "requests sent one at a time after the server's warm-up; medians"}


def bring_up(fixed: list[System], planners: Callable[[list[str]], list[System]], args: argparse.Namespace,
             vocab: int, logdir: Path, rules: dict, report: dict, servers: dict[str, Server]
             ) -> tuple[list[System], dict]:
    """Start every fixed system and measure its unloaded latency, derive the regimes from them,
    then start the planners (`planners(regime names)`) with their regime's SLOs. The servers
    land in `servers` as they start (the caller stops them); returns (every system, regimes)."""
    report["unloaded"] = {}
    for system in fixed:
        servers[system.name] = start(system, args, vocab, logdir, {})
        report["unloaded"][system.name] = u = unloaded(servers[system.name], args, vocab)
        log(f"{system.name}: unloaded TTFT {u['ttft_ms']:.1f} ms, TPOT {u['tpot_ms']:.2f} ms")
    regimes = derive(report["unloaded"], rules)
    report["regimes"] = regimes
    for name, r in regimes.items():
        log(f"regime {name}: TTFT <= {r['ttft_ms']} ms, TPOT <= {r['tpot_ms']} ms ({r['rule']})")
    systems = fixed + planners(list(regimes))
    for system in systems[len(fixed):]:
        servers[system.name] = start(system, args, vocab, logdir, regimes)
        report["unloaded"][system.name] = unloaded(servers[system.name], args, vocab)
    report["systems"] = {s.name: {**asdict(s), "command": getattr(servers[s.name], "cmd", None)} for s in systems}
    return systems, regimes


