"""The SLO planner on held-out traffic: its settings are tuned on one trace and seeds, frozen in
a committed file, and evaluated on another trace and seeds the tuning never saw, against every
fixed split of the same cores.

    python -m benchmarks.slo.planner_heldout tune [--windows 0:0,1500:1] [--trace synthetic]
        [--candidates FILE] [--freeze benchmarks/slo/planner_frozen.json] [--out ...]
    python -m benchmarks.slo.planner_heldout evaluate [--frozen benchmarks/slo/planner_frozen.json]
        [--trace conversation] [--windows 3000:100,8000:101] [--out ...]
    (both: [--model DIR] [--rates 0.5,1,2] [--num-prompts 100] [--max-minutes 120] [--no-ledger])

Traffic: a window of a Mooncake trace (/work/shared/data/mooncake, README there) -- `--num-prompts`
consecutive requests from row START, replayed on the small qwen3 with lengths and 512-token
hash blocks / 32 (16-token blocks; prompts capped at --max-input tokens, outputs at
--max-output), each hash id mapped to a fixed random token block so that prefix reuse is the
trace's (the map's seed: the window's SEED and the point: no reuse across points), ties of the
trace's 3 s clock spread evenly, time compressed to each of `--rates` (mean req/s). A window
`START:SEED` is one pass of benchmarks/compare's interleaved sweep.

Systems (benchmarks/compare/systems.py and sweep.py: the same servers, budgets, warm-ups, unloaded latency,
regimes derived from it and judging): pdserve colocated on 2 threads, 1P+1D on 1 each, and one
planner server per regime (and, when tuning, per candidate setting), from colocated.

- `tune`: every candidate (a JSON list of {"name", "flags"}; default: pdserve's shipped
  settings, and the slower window, sustain and cooldown (5 s, 3, 30 s) it shipped with before) on the tuning windows; the candidate with the highest attainment,
  averaged over its regimes and points, is written with the regime rule and the tuning's trace
  and windows to --freeze. Commit that file before evaluating.
- `evaluate`: refuses unless the frozen file is committed and unchanged, its tuning trace and
  windows do not overlap the evaluation's (same trace file: no shared rows; and no shared seed);
  then the frozen planner against the fixed splits on the evaluation windows.

Every run (either mode) is appended to docs/results/slo/planner_heldout/runs.jsonl with its JSON's
path, its commit and its knees (`--no-ledger`: a trial not to be cited, marked so in its JSON):
a claim cites its runs from that ledger, all of them.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.compare.regimes import parse_rules
from benchmarks.compare.run import print_summary
from benchmarks.compare.sweep import finish, sweep
from benchmarks.compare.systems import Load, System, bring_up, fixed_systems
from benchmarks.harness.facts import machine_load, run_facts
from benchmarks.harness.models import ensure_model
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import DOCS_RESULTS, REPO, RESULTS
from benchmarks.harness.servers import Server
from benchmarks.harness.traces import CONVERSATION, SYNTHETIC, spread_ties
from pdserve.common.config import ModelConfig
from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.router.bench.workloads import BenchRequest, mooncake_workload
from pdserve.router.core.config import RouterConfig
from pdserve.router.stats.intervals import MIN_REQUESTS_PER_POINT

TRACES = {"conversation": CONVERSATION, "synthetic": SYNTHETIC}
FROZEN = REPO / "benchmarks" / "slo" / "planner_frozen.json"
LEDGER = DOCS_RESULTS / "slo" / "planner_heldout" / "runs.jsonl"
SCALE = 32  # trace tokens per model token (lengths and hash blocks)
# The planner settings a candidate names (the rest stay pdserve's defaults).
TUNED = ("planner_interval_s", "planner_sustain", "planner_cooldown_s", "planner_min_requests", "planner_memory_s",
         "planner_load_band", "planner_target", "planner_miss_z")
SHIPPED = {f.name: f.default for f in dataclasses.fields(RouterConfig) if f.name in TUNED}
DEFAULT_CANDIDATES = [
    {"name": "shipped", "flags": SHIPPED},  # window 3 s, sustain 2, cooldown 15 s, ...
    {"name": "slow", "flags": {**SHIPPED, "planner_interval_s": 5.0, "planner_sustain": 3, "planner_cooldown_s": 30.0}},
    # the shipped settings with latency models (`pdserve profile` of this machine, made by the run)
    {"name": "models", "flags": SHIPPED, "latency_models": True},
]


def profile_models(model: str, logdir: Path, report: dict) -> str:
    """`pdserve profile` of `model` at this host's cores and half of them (the planner's
    colocated and split layouts; float32, unquantized, as the systems are served), written
    under `logdir`; the comma-joined paths `--planner-latency-models` takes. The commands,
    their seconds and each model's figures go into `report["latency_models"]`."""
    cores = os.cpu_count() or 2
    paths, made = [], []
    for threads in (cores, cores // 2):
        out = logdir / f"latency_model_t{threads}.json"
        cmd = [sys.executable, "-m", "pdserve", "profile", model, "--dtype", "float32", "--quantization", "none",
               "--num-threads", str(threads), "--out", str(out)]
        t = time.monotonic()
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"planner_heldout: {' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
        made.append({"num_threads": threads, "command": " ".join(cmd[1:]), "seconds": round(time.monotonic() - t, 1),
                     "model": json.loads(out.read_text())})
        paths.append(str(out))
    report["latency_models"] = made
    return ",".join(paths)


def parse_windows(text: str) -> list[tuple[int, int]]:
    """`START:SEED,...` -> [(start row, seed)]."""
    out = []
    for part in filter(None, text.split(",")):
        start, _, seed = part.partition(":")
        out.append((int(start), int(seed)))
    if not out:
        raise ValueError("no windows given")
    return out


def trace_load(path: Path, start: int, seed: int, args: argparse.Namespace, vocab: int) -> Load:
    """A window of the trace as a Load: point k maps hash ids with seed 1000 * SEED + k (the
    trace's reuse inside a point, none across points), ties spread, time set to the rate."""
    def load(k: int, rate: float, n: int) -> tuple[list[BenchRequest], list[float]]:
        reqs = mooncake_workload(path, n, SCALE, vocab, 1.0, start, args.max_output, args.max_input, 1000 * seed + k)
        arrivals = spread_ties([r.arrival or 0.0 for r in reqs])
        span = max(arrivals) - min(arrivals)
        scale = rate * span / len(reqs) if span > 0 else 1.0  # the trace's clock / this: n requests in n / rate s
        t0 = min(arrivals)
        return reqs, [(a - t0) / scale for a in arrivals]
    return load


def candidate_flags(candidate: dict, models: str) -> tuple[tuple[str, str], ...]:
    """A candidate's planner flags as (name, value) pairs; with `latency_models`, the profiled
    models' paths (`models`) as `--planner-latency-models`."""
    extra = {"planner_latency_models": models} if candidate.get("latency_models") else {}
    return tuple((k, str(v)) for k, v in {**candidate["flags"], **extra}.items())


def window_facts(path: Path, windows: list[tuple[int, int]], n: int) -> dict:
    return {"trace": str(path), "windows": [{"start": s, "seed": seed, "rows": [s, s + n]} for s, seed in windows]}


def overlap(tuning: dict, evaluation: dict) -> list[str]:
    """Why an evaluation is not held out from a tuning: shared rows of one trace, shared seeds."""
    why = []
    if Path(tuning["trace"]).resolve() == Path(evaluation["trace"]).resolve():
        for a in tuning["windows"]:
            for b in evaluation["windows"]:
                if a["rows"][0] < b["rows"][1] and b["rows"][0] < a["rows"][1]:
                    why.append(f"rows {b['rows']} overlap the tuning's {a['rows']} of the same trace")
    shared = {w["seed"] for w in tuning["windows"]} & {w["seed"] for w in evaluation["windows"]}
    if shared:
        why.append(f"seeds {sorted(shared)} were the tuning's")
    return why


def frozen_state(path: Path) -> dict:
    """The frozen file's commit, or why it is not frozen (untracked, or changed since)."""
    def git(*a: str) -> str:
        done = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""
    rel = str(path.resolve().relative_to(REPO)) if path.resolve().is_relative_to(REPO) else str(path)
    commit = git("log", "-1", "--format=%H %cI", "--", rel)
    if not commit:
        return {"frozen": False, "why": f"{rel} is not committed"}
    if git("status", "--porcelain", "--", rel):
        return {"frozen": False, "why": f"{rel} has uncommitted changes"}
    sha, date = commit.split(" ", 1)
    return {"frozen": True, "file": rel, "commit": sha, "committed": date}


def pick(report: dict, candidates: list[dict]) -> dict:
    """The candidate whose planners' attainment, averaged over their regimes and points, is highest."""
    scores = {}
    for c in candidates:
        vals = [p["by_regime"][r]["slo_attainment"] for name, pts in report.get("points", {}).items()
                if name.startswith("pdserve-planner-") and name.endswith(f"-{c['name']}@float32")
                for p in pts for r in p.get("by_regime", {})]
        scores[c["name"]] = sum(vals) / len(vals) if vals else -1.0
    best = max(candidates, key=lambda c: scores[c["name"]])
    return {"scores": scores, "chosen": best["name"], "flags": best["flags"],
            "latency_models": bool(best.get("latency_models"))}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("mode", choices=("tune", "evaluate"))
    p.add_argument("--model", default=None, help="default: the small qwen3, made once under results/models")
    p.add_argument("--trace", choices=tuple(TRACES), default=None,
                   help="tune: default synthetic; evaluate: default conversation")
    p.add_argument("--windows", default=None, help="START:SEED,... (tune default 0:0,1500:1; evaluate 3000:100,8000:101)")
    p.add_argument("--rates", default="0.5,1,2")
    p.add_argument("--num-prompts", type=int, default=MIN_REQUESTS_PER_POINT)
    p.add_argument("--max-input", type=int, default=768, help="prompt tokens at most (after / 32)")
    p.add_argument("--max-output", type=int, default=64, help="output tokens at most (after / 32)")
    p.add_argument("--unloaded-requests", type=int, default=10)
    p.add_argument("--candidates", default=None, help="tune: a JSON list of {name, flags[, latency_models: true]}")
    p.add_argument("--regimes", default="ttft_bound=3:10,tpot_bound=10:2", help="tune: the rule frozen with the flags")
    p.add_argument("--freeze", default=str(FROZEN), help="tune: where the chosen setting is written")
    p.add_argument("--frozen", default=str(FROZEN), help="evaluate: the committed frozen file")
    p.add_argument("--planner-warmup-s", type=float, default=20.0)
    p.add_argument("--max-minutes", type=float, default=120.0, help="no point starts after this")
    p.add_argument("--no-ledger", action="store_true", help="a trial: not recorded in the ledger, not to be cited")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    args.trace = args.trace or ("synthetic" if args.mode == "tune" else "conversation")
    args.windows = args.windows or ("0:0,1500:1" if args.mode == "tune" else "3000:100,8000:101")
    args.out = args.out or str(RESULTS / "slo" / f"planner_heldout_{args.mode}.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    freeze_startup_heap()
    t0 = time.monotonic()
    out_path = Path(args.out)
    logdir = RESULTS / "logs" / out_path.stem  # server logs: scratch, never beside a committed result
    logdir.mkdir(parents=True, exist_ok=True)
    trace, windows = TRACES[args.trace], parse_windows(args.windows)
    traffic = window_facts(trace, windows, args.num_prompts)
    report: dict = {**run_facts(), "what": f"the SLO planner on held-out traffic: {args.mode}",
                    "mode": args.mode, "traffic": traffic, "ledger": not args.no_ledger}
    if args.mode == "evaluate":
        state = frozen_state(Path(args.frozen))
        if not state["frozen"]:
            sys.exit(f"planner_heldout evaluate: {state['why']}: commit the frozen file before evaluating")
        frozen = json.loads(Path(args.frozen).read_text())
        why = overlap(frozen["tuning"]["traffic"], traffic)
        if why:
            sys.exit("planner_heldout evaluate: not held out: " + "; ".join(why))
        report["frozen"] = {**state, "settings": frozen}
        candidates = [{"name": "frozen", "flags": frozen["flags"],
                       "latency_models": bool(frozen.get("latency_models"))}]
        rules = parse_rules(frozen["regimes"])
    else:
        candidates = json.loads(Path(args.candidates).read_text()) if args.candidates else DEFAULT_CANDIDATES
        rules = parse_rules(args.regimes)
    args.model = str(ensure_model(args.model))
    vocab = ModelConfig.from_dir(args.model).vocab_size
    loads = [trace_load(trace, start, seed, args, vocab) for start, seed in windows]
    sample, _ = loads[0](0, 1.0, args.num_prompts)
    ins, outs = sorted(r.prompt_len for r in sample), sorted(r.output_len for r in sample)
    # the unloaded and warm-up requests: the window's median prompt, and at least 8 tokens out so
    # that a TPOT is measured (a trace's median output / 32 can be 1 or 2 tokens)
    args.input_len, args.output_len = ins[len(ins) // 2], max(8, outs[len(outs) // 2])
    args.planner_flags, args.repeats = {}, len(windows)
    report.update(model=args.model, dtype="float32", candidates=candidates, regime_rule=args.regimes,
                  workload={"rates": [float(r) for r in args.rates.split(",")], "num_prompts": args.num_prompts,
                            "scale": SCALE, "max_input": args.max_input, "max_output": args.max_output,
                            "median_input": args.input_len, "median_output": args.output_len, "repeats": len(windows),
                            "input_len": args.input_len, "output_len": args.output_len},
                  machine_load_before=machine_load(), shared_machine_note=None)
    fixed = fixed_systems(["colocated", "1p1d"], ["float32"])

    # a candidate (or the frozen setting) with "latency_models": its planners get this machine's
    # models, profiled now (before any server starts: the profile has the machine to itself)
    models = profile_models(args.model, logdir, report) if any(c.get("latency_models") for c in candidates) else ""

    def planners(regimes: list[str]) -> list[System]:
        return [System(f"pdserve-planner-{r}-{c['name']}@float32", "pdserve", "planner", "float32", r,
                       candidate_flags(c, models))
                for c in candidates for r in regimes]
    servers: dict[str, Server] = {}
    try:
        systems, regimes = bring_up(fixed, planners, args, vocab, logdir, rules, report, servers)
        sweep(systems, servers, report["workload"]["rates"], loads, args, regimes, report, out_path, t0)
    finally:
        for s in servers.values():
            s.stop()
    finish(report, t0)
    if args.mode == "tune":
        report["choice"] = pick(report, candidates)
        frozen = {"about": "the SLO planner's settings, frozen before its held-out evaluation "
                           "(python -m benchmarks.slo.planner_heldout); commit before evaluating",
                  "flags": report["choice"]["flags"], "latency_models": report["choice"]["latency_models"],
                  "regimes": args.regimes,
                  "tuning": {"traffic": traffic, "run": str(out_path), "scores": report["choice"]["scores"],
                             "date": report["date"], "commit": report["code"]["commit"]}}
        write_report(frozen, args.freeze)
    write_report(report, out_path)
    if not args.no_ledger:
        LEDGER.parent.mkdir(parents=True, exist_ok=True)
        with LEDGER.open("a") as f:
            f.write(json.dumps({"date": report["date"], "mode": args.mode, "json": str(out_path),
                                "command": report["command"], "code": report["code"], "traffic": traffic,
                                "knees": {r: {s: k["text"] for s, k in by.items()} for r, by in report.get("knees", {}).items()},
                                "skipped": len(report.get("skipped", [])),
                                "shared_machine_note": report["shared_machine_note"]}) + "\n")
    print_summary(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
