"""`pdserve simulate`: replay a Mooncake trace against a simulated deployment and write
`pdserve bench`'s JSON and plots; `--search` tries every split of `--workers` workers
(and all-colocated) under each disaggregation mode and reports the one with the most
goodput per worker."""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.common.config import ConfigError, SchedulerConfig
from pdserve.router.cli.bench import _details, _jsonable, _print
from pdserve.router.stats.latency import phase_breakdown, summarize
from pdserve.router.bench.workloads import mooncake_workload
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_policy import MODES
from pdserve.common.latency_model import LatencyModel
from pdserve.router.core.policy import POLICIES
from pdserve.router.simulate.sim import Deployment, Simulation

# Token values only make blocks distinct: ids below 256 are Python's shared small ints, so
# a full-length trace's prompts cost a list slot per token and no int object each.
TOKEN_VOCAB = 256


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", required=True, help="Mooncake trace .jsonl (timestamp ms, input/output_length, hash_ids)")
    p.add_argument("--latency-model", required=True, help="the file `pdserve profile` wrote (docs/slo.md)")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--colocated", type=int, default=0, help="simulate this many colocated workers instead of P + D")
    p.add_argument("--trace-scale", type=int, default=32, help="lengths and 512-token blocks / this (as pdserve bench)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="arrivals compressed by this factor")
    p.add_argument("--trace-start-s", type=float, default=0.0, help="replay from this second of the trace")
    p.add_argument("--duration-s", type=float, default=None, help="replay this many seconds of the trace (default: all)")
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--routing", choices=POLICIES, default="prefix_load")
    p.add_argument("--disagg", choices=MODES, default="always")
    p.add_argument("--disagg-threshold-tokens", type=int, default=256)
    p.add_argument("--disagg-max-prefill-queue", type=int, default=0)
    p.add_argument("--disagg-tpot-guard-ms", type=float, default=0.0)
    p.add_argument("--block-size", type=int, default=None, help="default: the latency model's meta.block_size, else 16")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks per worker")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (with --host-cores)")
    p.add_argument("--host-cores", type=int, default=0, help="the cores all workers share: steps of workers "
                                                             "stepping at once stretch (0: a worker's own cores)")
    p.add_argument("--host-cpu-per-token-ms", type=float, default=0.0,
                   help="with --host-cores: CPU ms the router (and a client on the host) spend per token streamed; "
                        "a step whose workers fill the cores grows by it per token it streams")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--percentiles", default="90,99")
    p.add_argument("--search", action="store_true", help="find the split and disaggregation mode with the most "
                                                         "goodput per worker for --workers workers")
    p.add_argument("--workers", type=int, default=None, help="--search: total workers (default: prefill + decode)")
    p.add_argument("--search-disagg", default="always,never,threshold,cost", help="--search: modes to try")
    p.add_argument("--out", default="simulate_result.json")
    p.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the JSON")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here (as pdserve bench)")
    p.add_argument("--label", default=None)


def load_requests(args: argparse.Namespace) -> list[tuple[float, list[int], int]]:
    """(arrival s, prompt ids, output tokens) for the trace window, via bench's loader."""
    start_ms, end_ms = args.trace_start_s * 1000, float("inf")
    if args.duration_s is not None:
        end_ms = start_ms + args.duration_s * 1000
    first = count = 0
    with open(args.trace) as f:
        for i, line in enumerate(f):
            ts = json.loads(line)["timestamp"]
            if ts < start_ms:
                first = i + 1
            elif ts < end_ms:
                count += 1
            else:
                break
    reqs = mooncake_workload(args.trace, count, args.trace_scale, TOKEN_VOCAB, args.rate_scale, first,
                             args.max_output_len, args.max_input_len, args.seed)
    return [(r.arrival, r.prompt_token_ids, r.output_len) for r in reqs]  # type: ignore[misc]


def _block_size(args: argparse.Namespace, model: LatencyModel) -> int:
    return args.block_size or int(model.meta.get("block_size") or 16)


def simulate(args: argparse.Namespace, model: LatencyModel, requests: list, dep: Deployment, disagg: str) -> dict:
    """One run: bench's summary keys plus `simulator` (wall time, speed, steps)."""
    config = RouterConfig(model_dir="simulated", routing=args.routing, disagg=disagg, seed=args.seed,
                          disagg_threshold_tokens=args.disagg_threshold_tokens,
                          disagg_max_prefill_queue=args.disagg_max_prefill_queue,
                          disagg_latency_model=args.latency_model, disagg_tpot_guard_ms=args.disagg_tpot_guard_ms,
                          block_size=_block_size(args, model))
    sim = Simulation(dep, model, config)
    t0, c0 = time.perf_counter(), time.process_time()
    reqs = sim.run(requests)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    records = [r.record for r in reqs]
    for r in reqs:
        r.record.timeline = r.timeline
    span = max((t for r in records for t in r.token_times[-1:]), default=0.0)
    ttft_s = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    tpot_s = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None
    res = summarize(records, span, ttft_s, tpot_s, tuple(float(x) for x in args.percentiles.split(",")))
    res["request_rate"] = len(requests) / max(max((a for a, _, _ in requests), default=0.0), 1e-9)
    res.update(phase_breakdown(records))
    res["deployment"], res["disagg"], res["workers"] = dep.label, disagg, dep.workers
    res["goodput_per_worker"] = res["request_goodput"] / dep.workers
    res["simulator"] = {"wall_s": wall, "cpu_s": cpu, "simulated_s": span, "simulated_s_per_wall_s": span / wall if wall else None,
                        "steps": sum(w.steps for w in sim.workers.values()),
                        "preemptions": sum(w.scheduler.num_preemptions for w in sim.workers.values())}
    res["_records"] = records
    return res


def deployment(args: argparse.Namespace, prefill: int, decode: int, colocated: int) -> Deployment:
    sched = SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens)
    return Deployment(prefill, decode, colocated, args.num_blocks, sched, args.threads, args.host_cores,
                      args.host_cpu_per_token_ms / 1000)


def candidates(workers: int, modes: list[str]) -> list[tuple[int, int, int, str]]:
    """(prefill, decode, colocated, disagg mode): every P + D = workers under each mode,
    and all colocated (where the mode does not matter)."""
    out = [(p, workers - p, 0, m) for p in range(1, workers) for m in modes]
    return out + [(0, 0, workers, "always")]


def search(args: argparse.Namespace, model: LatencyModel, requests: list) -> dict:
    """Every candidate's figures, best first (most goodput per worker, then attainment)."""
    workers = args.workers or (args.colocated or args.prefill + args.decode)
    modes = [m for m in args.search_disagg.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ConfigError(f"--search-disagg: {', '.join(bad)} is not one of {', '.join(MODES)}")
    rows = []
    for p, d, c, mode in candidates(workers, modes):
        res = simulate(args, model, requests, deployment(args, p, d, c), mode)
        res.pop("_records")
        rows.append({k: res[k] for k in ("deployment", "disagg", "workers", "goodput_per_worker", "request_goodput",
                                         "slo_attainment", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms",
                                         "p90_tpot_ms")})
        print(f"  {res['deployment']:<8} {mode:<9} goodput/worker {res['goodput_per_worker']:.3f} req/s  "
              f"attainment {res['slo_attainment']:.3f}")
    rows.sort(key=lambda r: (-r["goodput_per_worker"], -r["slo_attainment"]))
    return {"best": rows[0], "candidates": rows}


def main(args: argparse.Namespace) -> int:
    model = LatencyModel.load(args.latency_model)
    requests = load_requests(args)
    if not requests:
        raise ConfigError("the trace window holds no request (--trace-start-s / --duration-s)")
    config = {k: v for k, v in vars(args).items() if k != "func"}
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": "simulate", "label": args.label,
                 "num_prompts": len(requests), "config": config}
    if args.search:
        out.update(search(args, model, requests))
        b = out["best"]
        print(f"best: {b['deployment']} disagg {b['disagg']}: {b['goodput_per_worker']:.3f} req/s per worker")
    else:
        try:
            dep = deployment(args, 0 if args.colocated else args.prefill, 0 if args.colocated else args.decode,
                             args.colocated)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        res = simulate(args, model, requests, dep, args.disagg)
        records = res.pop("_records")
        out.update(res)
        _print(res)
        sim = res["simulator"]
        print(f"  simulated {sim['simulated_s']:.1f} s in {sim['wall_s']:.1f} s wall ({sim['steps']} steps)")
        if args.save_detailed or args.plot_dir:
            details = _details(records)
            if args.save_detailed:
                out.update(details)
            if args.plot_dir:
                from pdserve.router.bench import plots
                plots.plot_latency_cdf(details, Path(args.plot_dir) / "latency_cdf.png")
                plots.plot_timelines(details["timelines"], Path(args.plot_dir) / "timelines.png")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2, default=_jsonable))
    print(f"wrote {args.out}")
    return 0
