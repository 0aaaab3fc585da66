"""`pdserve bench` and `pdserve bench-plot`: argument parsing and the run/sweep driver."""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.router.bench.arrivals import arrival_times
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import (BenchRequest, mooncake_workload, random_workload, sharegpt_workload,
                                            shared_prefix_workload)
from pdserve.router.stats.intervals import MIN_REQUESTS_PER_POINT
from pdserve.router.stats.knee import goodput_knee, knee_bounds
from pdserve.router.stats.latency import attainment, phase_breakdown, summarize

# A sweep point's seed offset: point i's prompts and send times use seed + i * POINT_SEED_STRIDE,
# so that no point finds an earlier point's prompts in the server's prefix cache.
POINT_SEED_STRIDE = 1000
WARMUP_SEED_OFFSET = 999  # the warm-up prompts' seed (+ seed): never a measured point's


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["zmq", "http"], default="zmq")
    p.add_argument("--url", required=True, help="zmq: tcp://host:port; http: http://host:port/v1")
    p.add_argument("--model", default=None, help="model dir (vocabulary size, tokenizer for sharegpt); default: embedded")
    p.add_argument("--workload", choices=["random", "shared-prefix", "sharegpt", "mooncake"], default="random")
    p.add_argument("--num-prompts", type=int, default=MIN_REQUESTS_PER_POINT,
                   help=f"requests per point (default {MIN_REQUESTS_PER_POINT}: one request then moves SLO attainment "
                        f"by 1 point; fewer widen the attainment's 95%% interval, printed beside it)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--range-ratio", type=float, default=0.0)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--prompts-per-group", type=int, default=16)
    p.add_argument("--system-prompt-len", type=int, default=256)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--dataset-path", default=None, help="sharegpt JSON or Mooncake trace .jsonl")
    p.add_argument("--trace-scale", type=int, default=32, help="Mooncake: lengths and 512-token blocks / this")
    p.add_argument("--time-scale", type=float, default=1.0, help="Mooncake: arrivals compressed by this factor")
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--max-output-len", type=int, default=None)
    p.add_argument("--max-input-len", type=int, default=None)
    p.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (inf: all at once)")
    p.add_argument("--request-rates", default=None, help="sweep, e.g. 0.5,1,2,4")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape: 1 Poisson, <1 burstier")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--slo-scales", default=None, help="scale both SLOs, e.g. 0.5,1,2 (attainment per scale)")
    p.add_argument("--percentiles", default="90,99")
    p.add_argument("--warmup", type=int, default=2,
                   help="warm-up requests per point, sent one at a time before it with prompts of their own; "
                        "excluded from every figure (the JSON's `warmup` says so)")
    p.add_argument("--seed", type=int, default=0,
                   help=f"prompts and send times; sweep point i uses seed + {POINT_SEED_STRIDE} * i (fresh prompts)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-timeline", action="store_true", help="do not ask the server for per-request timelines")
    p.add_argument("--out", default="bench_result.json")
    p.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the JSON")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--label", default=None)
    p.add_argument("--no-progress", action="store_true")


def build_workload(args: argparse.Namespace, seed: int | None = None) -> list[BenchRequest]:
    """The measured requests of one point, made with `seed` (default: --seed)."""
    from pdserve.common.config import ModelConfig
    from pdserve.common.loading.default_model import resolve_model
    seed = args.seed if seed is None else seed
    model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    if args.workload == "random":
        return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.groups, args.prompts_per_group, args.system_prompt_len,
                                      args.question_len, args.output_len, vocab, seed)
    if not args.dataset_path:
        raise ValueError(f"--workload {args.workload} needs --dataset-path")
    if args.workload == "sharegpt":
        from pdserve.common.text.tokenizer import Tokenizer
        return sharegpt_workload(args.dataset_path, args.num_prompts, Tokenizer(model_dir), None, seed=seed)
    return mooncake_workload(args.dataset_path, args.num_prompts, args.trace_scale, vocab, args.time_scale,
                             args.trace_start, args.max_output_len, args.max_input_len, seed)


def warmup_workload(args: argparse.Namespace, reqs: list[BenchRequest]) -> list[BenchRequest]:
    """`--warmup` random prompts as long as the workload's median prompt and output, with a
    seed no point uses: they warm the server without warming its prefix cache for `reqs`."""
    if args.warmup <= 0 or not reqs:
        return []
    from pdserve.common.config import ModelConfig
    from pdserve.common.loading.default_model import resolve_model
    vocab = ModelConfig.from_dir(resolve_model(args.model)).vocab_size
    ins = sorted(max(1, r.prompt_len) for r in reqs)
    outs = sorted(r.output_len for r in reqs)
    return random_workload(args.warmup, ins[len(ins) // 2], outs[len(outs) // 2], 0.0, vocab,
                           args.seed + WARMUP_SEED_OFFSET)


def _send_times(reqs: list[BenchRequest], rate: float, args: argparse.Namespace, seed: int) -> list[float]:
    if reqs and all(r.arrival is not None for r in reqs):  # trace replay: the trace's own clock
        scale = 1.0 if args.request_rates is None else rate / _trace_rate(reqs)
        return [r.arrival / scale for r in reqs]  # type: ignore[operator]
    return arrival_times(len(reqs), rate, args.burstiness, seed)


def _trace_rate(reqs: list[BenchRequest]) -> float:
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)  # type: ignore[type-var]
    return len(reqs) / span if span > 0 else float("inf")


def run_once(args: argparse.Namespace, reqs: list[BenchRequest], rate: float, seed: int) -> dict:
    """One point: the warm-up (not counted), then `reqs` at `rate`; its summary, with the
    records under `_records`."""
    percentiles = tuple(float(x) for x in args.percentiles.split(","))
    send_times = _send_times(reqs, rate, args, seed)
    records, duration = asyncio.run(run_workload(
        reqs, args.backend, args.url, send_times, args.max_concurrency, args.temperature, True,
        not args.no_timeline, warmup_workload(args, reqs), not args.no_progress))
    ttft_s = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    tpot_s = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None
    res = summarize(records, duration, ttft_s, tpot_s, percentiles)
    res["request_rate"] = rate if rate != float("inf") else "inf"
    if reqs and reqs[0].arrival is not None:  # trace replay: report the rate actually offered
        res["request_rate"] = len(reqs) / max(send_times[-1], 1e-9)
    res["seed"] = seed
    res.update(phase_breakdown(records))
    if args.slo_scales:
        res["slo_scale_attainment"] = {s: attainment(records, ttft_s and ttft_s * float(s), tpot_s and tpot_s * float(s))
                                       for s in args.slo_scales.split(",")}
    res["_records"] = records
    return res


def sweep_knee(sweep: list[dict], target: float = 0.9) -> dict:
    """The sweep's goodput knee (censored where the sweep does not bracket it) and the knee
    again at the ends of the points' attainment intervals."""
    rates = [p["request_rate"] for p in sweep]
    knee = goodput_knee(rates, [p["slo_attainment"] for p in sweep], target).as_json()
    knee["interval_ends"] = knee_bounds(rates, [p["slo_attainment_ci95"][0] for p in sweep],
                                        [p["slo_attainment_ci95"][1] for p in sweep], target)
    return knee


def _details(records) -> dict:
    return {"input_lens": [r.prompt_len for r in records], "output_lens": [r.output_len for r in records],
            "ttfts": [r.ttft for r in records], "tpots": [r.tpot for r in records],
            "e2els": [r.e2e for r in records], "itls": [r.itls for r in records],
            "errors": [r.error for r in records], "timelines": [r.timeline for r in records]}


def main(args: argparse.Namespace) -> int:
    reqs = build_workload(args)
    if not reqs:
        raise ValueError("the workload is empty")
    freeze_startup_heap()  # a collection of the client's start-up heap would stall its clocks mid-run
    config = {k: v for k, v in vars(args).items() if k != "func"}
    config["request_rate"] = str(args.request_rate)
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "backend": args.backend, "label": args.label,
                 "num_prompts": len(reqs), "config": config,
                 "warmup": {"requests_per_point": max(0, args.warmup), "excluded": True,
                            "how": "random prompts of the workload's median lengths and a seed of their own, "
                                   "sent one at a time before each point; in no figure"}}
    if len(reqs) < MIN_REQUESTS_PER_POINT:
        print(f"note: {len(reqs)} requests a point: one request moves attainment by {100 / len(reqs):.1f} points "
              f"(>= {MIN_REQUESTS_PER_POINT} for <= 1)")
    errors: list[str] = []  # every failed request's cause, in order
    if args.request_rates:
        sweep = []
        for i, rate in enumerate(float(x) for x in args.request_rates.split(",")):
            print(f"-- request rate {rate} req/s")
            seed = args.seed + POINT_SEED_STRIDE * i
            res = run_once(args, reqs if i == 0 else build_workload(args, seed), rate, seed)
            errors += [r.error for r in res.pop("_records") if not r.success]
            sweep.append(res)
            _print(res)
        out["sweep"] = sweep
        out["goodput_knee"] = sweep_knee(sweep)
        print(f"goodput knee (highest rate with >= 90% SLO attainment there and below): {out['goodput_knee']['text']}")
        if args.plot_dir:
            from pdserve.router.bench import plots
            plots.plot_attainment([out], [args.label or args.workload], Path(args.plot_dir) / "attainment_vs_rate.png")
            plots.plot_latency_vs_rate([out], [args.label or args.workload], Path(args.plot_dir) / "latency_vs_rate.png")
    else:
        res = run_once(args, reqs, args.request_rate, args.seed)
        records = res.pop("_records")
        errors += [r.error for r in records if not r.success]
        out.update(res)
        _print(res)
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
    if errors:  # a run with failed requests is a failed run, whatever else it measured
        print(f"pdserve bench: {len(errors)} request(s) failed; the first: {errors[0]}", file=sys.stderr)
        return 1
    return 0


def _jsonable(o):
    if hasattr(o, "__dataclass_fields__"):
        return asdict(o)
    return str(o)


def _print(res: dict) -> None:
    keys = ["completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "request_goodput"]
    for k in keys:
        if k in res:
            v = res[k]
            ci = res.get(f"{k}_ci95")
            text = f"{v:.3f}" if isinstance(v, float) else f"{v}"
            print(f"  {k:<22} {text}" + (f"  [{ci[0]:.3f}, {ci[1]:.3f}] 95% CI" if ci else ""))
    lo, hi = res["slo_attainment_ci95"]
    print(f"  {'slo_attainment':<22} {res['slo_attainment']:.1%}  [{lo:.1%}, {hi:.1%}] 95% Wilson "
          f"({res['slo_met']}/{res['slo_requests']})")


def add_plot_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("results", nargs="+", help="result JSON files from `pdserve bench --request-rates`")
    p.add_argument("--labels", default=None, help="comma-separated, one per file")
    p.add_argument("--out", default="attainment_vs_rate.png")


def plot_main(args: argparse.Namespace) -> int:
    from pdserve.router.bench import plots
    results = [plots.load(p) for p in args.results]
    labels = args.labels.split(",") if args.labels else [r.get("label") or Path(p).stem for r, p in zip(results, args.results)]
    print(f"wrote {plots.plot_attainment(results, labels, args.out)}")
    return 0
