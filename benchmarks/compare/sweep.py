"""The interleaved sweep of a comparison: each (pass, rate) on every system in turn, a
planner's point after its warm-up streams, each point judged under its regimes, the passes of
a rate pooled, the knees, the report rewritten after every point."""
from __future__ import annotations

import argparse
import asyncio
import math
import time
from pathlib import Path

from benchmarks.compare.judge import attainment_under, knees
from benchmarks.compare.systems import POINT_TIMEOUT_S, Load, System, serve
from benchmarks.harness.facts import busy_cpu_s, machine_load, own_tree_cpu_s
from benchmarks.harness.output import write_report
from benchmarks.harness.planner_watch import DecisionPoller, pools, settle
from benchmarks.harness.servers import Server, log, tree_cpu_s
from pdserve.router.stats.latency import RequestRecord, summarize


def planner_warmup(s: Server, args: argparse.Namespace, rate: float, seed: int, load: Load) -> dict:
    """Streams at `rate` until one passes without a planner change (at most 2), each of at
    least `--planner-warmup-s` of traffic and enough requests for the planner to judge."""
    n = max(2, math.ceil(rate * args.planner_warmup_s), int(args.planner_flags.get("planner_min_requests", 10)) + 3)
    t0, rounds = time.time(), []
    for i in range(2):
        reqs, times = load(50_000 + 10 * seed + i, rate, n)
        poller = DecisionPoller(s.url, t0).since_now()
        recs, _ = serve(s, reqs, times)
        pool = settle(s.url)
        rounds.append({"requests": n, "ok": sum(r.success for r in recs), "pool": pool, "decisions": poller.stop()})
        if not rounds[-1]["decisions"]:
            break
    return {"settled_s": round(time.time() - t0, 1), "pool": rounds[-1]["pool"], "rounds": rounds}


def point(s: Server, system: System, args: argparse.Namespace, rate: float, k: int, load: Load,
          regimes: dict, others: list[Server]) -> tuple[dict, list[RequestRecord]]:
    """One measured point of `system` at `rate` (its seed k), judged under its regimes."""
    out: dict = {"request_rate": rate, "seed": k, "load_before": machine_load(sample_s=0.2)}
    if system.layout == "planner":
        out["planner_warmup"] = planner_warmup(s, args, rate, k, load)
    reqs, times = load(k, rate, args.num_prompts)
    out["offered_rate"] = len(times) / times[-1] if times and times[-1] > 0 else None
    poller = DecisionPoller(s.url, time.time()).since_now() if system.layout == "planner" else None
    busy0, tree0 = busy_cpu_s(), own_tree_cpu_s()
    idle0 = {o.name: tree_cpu_s(o.ps) for o in others}
    try:
        records, duration = serve(s, reqs, times)
    except asyncio.TimeoutError:
        out["error"] = f"timed out after {POINT_TIMEOUT_S:.0f} s"
        return out, []
    out.update(summarize(records, duration))
    out["other_cpu_s"] = round(busy_cpu_s() - busy0 - (own_tree_cpu_s() - tree0), 1)  # outside this process tree
    out["idle_servers_cpu_s"] = {o.name: round(tree_cpu_s(o.ps) - idle0[o.name], 1) for o in others}
    if poller:
        out["planner_decisions"], out["pools_after"] = poller.stop(), pools(s.url)
    own = [system.regime] if system.regime else list(regimes)
    out["by_regime"] = {r: attainment_under(records, regimes[r], duration) for r in own}
    out["load_after"] = machine_load(sample_s=0.2)
    out["errors"] = sorted({r.error for r in records if not r.success})[:3]
    for r, a in out["by_regime"].items():
        lo, hi = a["slo_attainment_ci95"]
        log(f"  {system.name:<34} {rate:g} req/s {r}: {a['slo_attainment']:5.0%} [{lo:.0%}, {hi:.0%}]  TTFT p50/p99 "
            f"{out['median_ttft_ms']:6.0f}/{out['p99_ttft_ms']:6.0f} ms  TPOT p50/p99 {out['median_tpot_ms']:5.1f}/"
            f"{out['p99_tpot_ms']:5.1f} ms  (load {out['load_before']['loadavg'][0]:.1f})")
    return out, records


def pooled(points: list[dict], records: list[list[RequestRecord]], regimes: dict, system: System,
           rate: float) -> dict:
    """A rate's passes folded into one point: attainment over every pass's requests."""
    flat = [r for rs in records for r in rs]
    dur = sum(p.get("duration", 0.0) for p in points)
    own = [system.regime] if system.regime else list(regimes)
    out = {"request_rate": rate, "passes": len(points), **summarize(flat, dur)} if flat else {"request_rate": rate}
    out["by_regime"] = {r: {**attainment_under(flat, regimes[r], dur),
                            "per_pass": [p["by_regime"][r]["slo_attainment"] for p in points if "by_regime" in p]}
                        for r in own} if flat else {}
    return out


def sweep(systems: list[System], servers: dict[str, Server], rates: list[float], loads: list[Load],
          args: argparse.Namespace, regimes: dict, report: dict, out_path: Path, t0: float) -> None:
    """One pass per load: each rate, lowest first, on every system in turn, the order reversed
    at every other (pass, rate); a (pass, rate) gives every system the same requests and send
    times (seed k). The report gets every pass's point, each rate's passes pooled, the knees;
    it is rewritten after every point. No point starts after --max-minutes."""
    raw: dict[tuple[str, float], list[dict]] = {}
    recs: dict[tuple[str, float], list[list[RequestRecord]]] = {}
    report.setdefault("skipped", [])
    k = 0
    for rep, load in enumerate(loads):
        for rate in rates:
            order = systems if k % 2 == 0 else systems[::-1]
            for system in order:
                if time.monotonic() - t0 > args.max_minutes * 60:
                    report["skipped"].append({"system": system.name, "rate": rate, "pass": rep,
                                              "why": f"--max-minutes {args.max_minutes} reached"})
                    continue
                others = [s for n, s in servers.items() if n != system.name]
                res, records = point(servers[system.name], system, args, rate, k, load, regimes, others)
                res["pass"] = rep
                raw.setdefault((system.name, rate), []).append(res)
                recs.setdefault((system.name, rate), []).append(records)
                report.setdefault("points", {})[system.name] = [
                    pooled(raw[(system.name, r)], recs[(system.name, r)], regimes, system, r)
                    for r in rates if (system.name, r) in raw]
                report["passes"] = {f"{n}@{r:g}": ps for (n, r), ps in raw.items()}
                report["knees"] = knees(report["points"], regimes)
                write_report(report, out_path)
            k += 1


def finish(report: dict, t0: float) -> None:
    """The machine's load at the end, whether it was shared, the run's length."""
    report["machine_load_after"] = machine_load()
    busy = max(report["machine_load_before"]["busy_other_processes"], report["machine_load_after"]["busy_other_processes"])
    report["shared_machine_note"] = (f"{busy} other process(es) busy (>= 10% of a core) at the start or end; load "
                                     f"average {report['machine_load_before']['loadavg'][0]} -> "
                                     f"{report['machine_load_after']['loadavg'][0]}: the figures are from a shared "
                                     f"machine" if busy else "no other busy process at the start or end")
    report["runtime_s"] = round(time.monotonic() - t0, 1)


