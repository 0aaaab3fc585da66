"""Every system on one trace, interleaved, in one process tree: vLLM's CPU build at its best
dtype for the chip and at pdserve's dtype, pdserve colocated, 1 prefill + 1 decode, and the
SLO planner (`serve --planner slo`), judged in SLO regimes derived from the systems' own
unloaded latency.

    python -m benchmarks.compare --vllm-python /work/vllm-venv/bin/python
        [--model DIR] [--pdserve-dtype float32] [--rates 1,2,4] [--num-prompts 100]
        [--input-len 256] [--output-len 64] [--regimes ttft_bound=3:10,tpot_bound=10:2]
        [--systems vllm,colocated,1p1d,planner] [--repeats 1] [--max-minutes 90]
        [--planner-config FILE] [--out results/compare/compare.json]

Method, in order:
1. Facts: the chip and its SIMD flags; vLLM's best dtype for it (bfloat16 where the CPU has
   AVX512_BF16 or AMX, float32 otherwise: on AVX2 vLLM's bf16 is an emulated slow path);
   the dtypes run = vLLM's best and `--pdserve-dtype` (one set when they are the same). At
   each dtype: vLLM, and pdserve at the same weights and precision (`--quantization none`:
   a GGUF model's kept-quantized linears would not be the weights vLLM runs).
2. Budgets, equal on both sides: --max-num-batched-tokens 2048 (vLLM's batched-token budget,
   pdserve's prefill chunk), --max-num-seqs 64, --max-model-len 1024; vLLM on both cores
   (VLLM_CPU_OMP_THREADS_BIND=0-1), pdserve colocated on 2 threads, 1P+1D on 1 each, the
   planner on the host's 2 cores from colocated (benchmarks/harness/servers.py).
3. Unloaded latency: every fixed system's server is started (each warmed up with two
   requests), and `--unloaded-requests` requests are sent to each one at a time; its
   median TTFT and TPOT (bootstrap 95% intervals) are its unloaded latency.
4. Regimes (benchmarks/compare/regimes.py): each bound a declared multiple of the slower
   system's unloaded TTFT / TPOT; default a TTFT-bound regime (3x / 10x) and a TPOT-bound one
   (10x / 2x). Then one planner server per regime and dtype is started with that regime's SLOs
   (its planner settings: pdserve's shipped defaults, or `--planner-config`).
5. The sweep, every server up: rate by rate, lowest first, every system in turn, the order
   reversed at every other rate; `--repeats` passes. A point: `--num-prompts` fresh random
   prompts (exactly --input-len in, --output-len out, ignore_eos, greedy), Poisson send times,
   the same prompts and times for every system at that rate and pass; one client for all
   (router/bench, HTTP). A planner's point is preceded by warm-up streams at its rate until one
   passes without a planner change (at most 2), its pools then left to settle; they are not
   counted. A fixed system or vLLM does not depend on the SLO: its point is judged under every
   regime; a planner's under its own.
6. Judging (benchmarks/compare/judge.py): per point and regime, attainment with its Wilson 95%
   interval; per system and regime, the goodput knee (router/stats/knee.py), censored where the
   sweep does not bracket it.
The JSON (rewritten after every point) holds the facts, every system's unloaded latency, the
regimes, every point with its latency figures (bootstrap intervals) and attainment per regime,
the knees, and the machine's load before and after each point. `--max-minutes` bounds the
run: a point that would start later is recorded as skipped. README's comparison table is
made from that JSON by `python -m benchmarks.compare.table`.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.compare.judge import attainment_under, knees
from benchmarks.compare.regimes import derive, parse_rules
from benchmarks.harness.facts import best_bf16_dtype, busy_cpu_s, machine_load, own_tree_cpu_s, run_facts
from benchmarks.harness.models import ensure_model
from benchmarks.harness.output import write_report
from benchmarks.harness.planner_watch import DecisionPoller, pools, settle
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.servers import (MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, PDSERVE_CONFIGS, VLLM_ENV, Server,
                                        log, start_pdserve, start_vllm, tree_cpu_s, vllm_version)
from pdserve.common.config import ModelConfig
from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.router.bench.arrivals import arrival_times
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import BenchRequest, random_workload
from pdserve.router.stats.intervals import MIN_REQUESTS_PER_POINT
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


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu; without it vLLM is left out")
    p.add_argument("--model", default=None, help="default: the small qwen3, made once under results/models")
    p.add_argument("--pdserve-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="pdserve's dtype; vLLM runs at it and at its own best dtype for the chip")
    p.add_argument("--rates", default="1,2,4")
    p.add_argument("--num-prompts", type=int, default=MIN_REQUESTS_PER_POINT,
                   help=f"requests per point and pass (default {MIN_REQUESTS_PER_POINT}: one request moves attainment "
                        f"by 1 point)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--unloaded-requests", type=int, default=10)
    p.add_argument("--regimes", default="ttft_bound=3:10,tpot_bound=10:2",
                   help="NAME=TTFT_MULTIPLE:TPOT_MULTIPLE of the slower system's unloaded latency, comma-separated")
    p.add_argument("--systems", default="vllm,colocated,1p1d,planner")
    p.add_argument("--repeats", type=int, default=1, help="passes over every rate and system, interleaved")
    p.add_argument("--planner-config", default=None,
                   help="a JSON file whose `flags` are the planner's settings (e.g. the frozen file of "
                        "benchmarks/slo/planner_heldout.py); default: pdserve's shipped defaults")
    p.add_argument("--planner-warmup-s", type=float, default=20.0)
    p.add_argument("--max-minutes", type=float, default=90.0, help="no point starts after this")
    p.add_argument("--out", default=str(RESULTS / "compare" / "compare.json"))
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.repeats < 1 or args.unloaded_requests < 2:
        p.error("--num-prompts and --repeats must be >= 1, --unloaded-requests >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    freeze_startup_heap()  # this process is the load generator: no 100 ms collections mid-run
    t0 = time.monotonic()
    out_path = Path(args.out)
    logdir = RESULTS / "logs" / out_path.stem  # server logs: scratch, never beside a committed result
    logdir.mkdir(parents=True, exist_ok=True)
    layouts = [s for s in args.systems.split(",") if s]
    vver = vllm_version(args.vllm_python) if "vllm" in layouts else None
    if "vllm" in layouts and vver is None:
        log(f"SKIPPING vLLM: {args.vllm_python or 'no --vllm-python'} cannot import vllm")
        layouts.remove("vllm")
    args.model = str(ensure_model(args.model))
    args.planner_flags = json.loads(Path(args.planner_config).read_text())["flags"] if args.planner_config else {}
    vocab = ModelConfig.from_dir(args.model).vocab_size
    best = best_bf16_dtype()
    dtypes = list(dict.fromkeys([best, args.pdserve_dtype]))
    rules = parse_rules(args.regimes)
    rates = [float(r) for r in args.rates.split(",")]
    report: dict = {
        **run_facts(), "what": "every system on one trace, interleaved, in one process tree (benchmarks/compare)",
        "vllm_version": vver, "vllm_env": VLLM_ENV | {"LD_PRELOAD": "libiomp5.so"}, "model": args.model,
        "dtypes": {"vllm_best_for_chip": best, "pdserve": args.pdserve_dtype, "run": dtypes,
                   "why": ("the CPU has AVX512_BF16 or AMX: vLLM's bf16 is its fast path" if best == "bfloat16" else
                           "the CPU has neither AVX512_BF16 nor AMX: vLLM's bf16 is an emulated slow path and "
                           "float32 is its best"),
                   "quantization": "none on both sides (pdserve --quantization none)"},
        "budgets": {"max_num_batched_tokens": MAX_BATCHED, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                    "note": "the same on both sides: vLLM's batched-token budget, pdserve's prefill chunk",
                    "threads": {"vllm": "VLLM_CPU_OMP_THREADS_BIND=0-1", **{k: v[-1] for k, v in PDSERVE_CONFIGS.items()},
                                "planner": "the host's cores, from colocated"}},
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "rates": rates, "repeats": args.repeats, "arrivals": "Poisson",
                     "prompts": "fresh random token ids per rate and pass, the same for every system"},
        "planner_settings": args.planner_flags or "pdserve's shipped defaults",
        "machine_load_before": machine_load(), "shared_machine_note": None,
    }
    fixed = fixed_systems(layouts, dtypes)
    load = random_load(args.input_len, args.output_len, vocab)
    servers: dict[str, Server] = {}
    try:
        systems, regimes = bring_up(fixed, lambda names: planner_systems(layouts, dtypes, names), args, vocab, logdir,
                                    rules, report, servers)
        sweep(systems, servers, rates, [load] * args.repeats, args, regimes, report, out_path, t0)
    finally:
        for s in servers.values():
            s.stop()
    finish(report, t0)
    write_report(report, out_path)
    print_summary(report)
    return 0


def print_summary(report: dict) -> None:
    """Each system's knee per regime, its unloaded latency beside it."""
    for regime, by_system in report.get("knees", {}).items():
        r = report["regimes"][regime]
        print(f"{regime} (TTFT <= {r['ttft_ms']} ms, TPOT <= {r['tpot_ms']} ms):")
        for system, knee in by_system.items():
            u = report["unloaded"].get(system, {})
            print(f"  {system:<36} knee {knee['text']:<70} unloaded TTFT {u.get('ttft_ms', float('nan')):.1f} ms, "
                  f"TPOT {u.get('tpot_ms', float('nan')):.2f} ms")
    if report.get("skipped"):
        print(f"skipped {len(report['skipped'])} point(s): --max-minutes reached")
    print(report["shared_machine_note"])


if __name__ == "__main__":
    sys.exit(main())
