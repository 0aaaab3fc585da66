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
from pdserve.router.stats.latency import attainment, goodput_rate, phase_breakdown, summarize
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import (BenchRequest, mooncake_workload, random_workload, sharegpt_workload,
                                    shared_prefix_workload)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["zmq", "http"], default="zmq")
    p.add_argument("--url", required=True, help="zmq: tcp://host:port; http: http://host:port/v1")
    p.add_argument("--model", default=None, help="model dir (vocabulary size, tokenizer for sharegpt); default: embedded")
    p.add_argument("--workload", choices=["random", "shared-prefix", "sharegpt", "mooncake"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
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
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-timeline", action="store_true", help="do not ask the server for per-request timelines")
    p.add_argument("--out", default="bench_result.json")
    p.add_argument("--save-detailed", action="store_true", help="add per-request arrays to the JSON")
    p.add_argument("--plot-dir", default=None, help="write PNG plots here")
    p.add_argument("--label", default=None)
    p.add_argument("--no-progress", action="store_true")


def build_workload(args: argparse.Namespace) -> list[BenchRequest]:
    from pdserve.common.config import ModelConfig
    from pdserve.common.loading.default_model import resolve_model
    model_dir = resolve_model(args.model)
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    if args.workload == "random":
        return random_workload(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab, args.seed)
    if args.workload == "shared-prefix":
        return shared_prefix_workload(args.groups, args.prompts_per_group, args.system_prompt_len,
                                      args.question_len, args.output_len, vocab, args.seed)
    if not args.dataset_path:
        raise ValueError(f"--workload {args.workload} needs --dataset-path")
    if args.workload == "sharegpt":
        from pdserve.common.text.tokenizer import Tokenizer
        return sharegpt_workload(args.dataset_path, args.num_prompts, Tokenizer(model_dir), None, seed=args.seed)
    return mooncake_workload(args.dataset_path, args.num_prompts, args.trace_scale, vocab, args.time_scale,
                             args.trace_start, args.max_output_len, args.max_input_len, args.seed)


def _send_times(reqs: list[BenchRequest], rate: float, args: argparse.Namespace) -> list[float]:
    if reqs and all(r.arrival is not None for r in reqs):  # trace replay: the trace's own clock
        scale = 1.0 if args.request_rates is None else rate / _trace_rate(reqs)
        return [r.arrival / scale for r in reqs]  # type: ignore[operator]
    return arrival_times(len(reqs), rate, args.burstiness, args.seed)


def _trace_rate(reqs: list[BenchRequest]) -> float:
    span = max(r.arrival for r in reqs) - min(r.arrival for r in reqs)  # type: ignore[type-var]
    return len(reqs) / span if span > 0 else float("inf")


def run_once(args: argparse.Namespace, reqs: list[BenchRequest], rate: float) -> dict:
    percentiles = tuple(float(x) for x in args.percentiles.split(","))
    send_times = _send_times(reqs, rate, args)
    records, duration = asyncio.run(run_workload(
        reqs, args.backend, args.url, send_times, args.max_concurrency, args.temperature, True,
        not args.no_timeline, args.warmup, not args.no_progress))
    ttft_s = args.slo_ttft_ms / 1000 if args.slo_ttft_ms else None
    tpot_s = args.slo_tpot_ms / 1000 if args.slo_tpot_ms else None
    res = summarize(records, duration, ttft_s, tpot_s, percentiles)
    res["request_rate"] = rate if rate != float("inf") else "inf"
    if reqs and reqs[0].arrival is not None:  # trace replay: report the rate actually offered
        res["request_rate"] = len(reqs) / max(send_times[-1], 1e-9)
    res.update(phase_breakdown(records))
    if args.slo_scales:
        res["slo_scale_attainment"] = {s: attainment(records, ttft_s and ttft_s * float(s), tpot_s and tpot_s * float(s))
                                       for s in args.slo_scales.split(",")}
    res["_records"] = records
    return res


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
                 "num_prompts": len(reqs), "config": config}
    errors: list[str] = []  # every failed request's cause, in order
    if args.request_rates:
        sweep = []
        for rate in [float(x) for x in args.request_rates.split(",")]:
            print(f"-- request rate {rate} req/s")
            res = run_once(args, reqs, rate)
            errors += [r.error for r in res.pop("_records") if not r.success]
            sweep.append(res)
            _print(res)
        out["sweep"] = sweep
        out["goodput_rate"] = goodput_rate([p["request_rate"] for p in sweep], [p["slo_attainment"] for p in sweep])
        print(f"goodput rate (highest rate with >= 90% SLO attainment): {out['goodput_rate']}")
        if args.plot_dir:
            from pdserve.router.bench import plots
            plots.plot_attainment([out], [args.label or args.workload], Path(args.plot_dir) / "attainment_vs_rate.png")
    else:
        res = run_once(args, reqs, args.request_rate)
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
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "slo_attainment",
            "request_goodput"]
    for k in keys:
        if k in res:
            v = res[k]
            print(f"  {k:<22} {v:.3f}" if isinstance(v, float) else f"  {k:<22} {v}")


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
