"""Conditional disaggregation against always-disaggregate at the same split (1 prefill + 1
decode worker, one torch thread each): TTFT of short prompts, and SLO attainment and
goodput at tight TTFT SLOs, on the Mooncake conversation trace. One run, modes side by side.

    python -m benchmarks.slo.conditional_disagg [--model DIR] [--requests 40] [--rate 2]
        [--modes always,threshold,cost] [--threshold 128] [--out-dir results/conditional_disagg]

Method:
1. Workload: `--requests` rows of /work/shared/data/mooncake/conversation_trace.jsonl
   from `--trace-start`, lengths and 512-token hash blocks / 32 (16-token blocks, so the
   trace's prefix reuse is kept), inputs capped at `--max-input`, outputs at
   `--max-output`; the requests of one trace timestamp spread over the gap to the next,
   time compressed to `--rate` req/s. Every mode gets the same requests at the same times.
2. cost mode: `pdserve profile` first, with the servers' engine flags (its file lands in
   --out-dir and is the mode's --disagg-latency-model; `--tpot-guard-ms` is its guard),
   unless `--latency-model FILE` names one.
3. Each mode on a fresh `pdserve serve --prefill 1 --decode 1 --disagg MODE`
   (benchmarks/harness/servers.py: --num-threads 1 per worker, float32), one after the other, over
   HTTP with per-request timelines (`pdserve bench`'s client, router/bench/runner.py).
4. Reported per mode: TTFT mean / p50 / p90 of the short prompts (fewer than `--short`
   tokens) and of all; TPOT p50 / p90; for each TTFT SLO in `--slo-ttft-ms` (TPOT <=
   `--slo-tpot-ms`) the attainment and goodput (requests meeting both SLOs per second);
   the router's decisions (/metrics) and the prompts each worker prefilled (timelines);
   ratios against `always`.
Writes --out-dir/conditional_disagg.json (and the latency model for cost mode).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np

from benchmarks.harness.paths import REPO

from pdserve.common.config import ModelConfig
from pdserve.router.stats.latency import RequestRecord, attainment, summarize
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import BenchRequest, mooncake_workload
from benchmarks.harness.servers import MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, log, start_pdserve
from benchmarks.harness.traces import CONVERSATION, spread_ties

TRACE = CONVERSATION
TRACE_SCALE = 32


def workload(args: argparse.Namespace, vocab: int, trace: Path = TRACE) -> list[tuple[BenchRequest, float]]:
    """(request, send time) pairs: the trace slice with ties spread, compressed to --rate."""
    reqs = mooncake_workload(trace, args.requests, TRACE_SCALE, vocab, start=args.trace_start,
                             max_output=args.max_output, max_input=args.max_input, seed=args.seed)
    spread = spread_ties([r.arrival or 0.0 for r in reqs])
    scale = (len(reqs) - 1) / args.rate / (spread[-1] - spread[0]) if spread[-1] > spread[0] else 1.0
    return [(r, (t - spread[0]) * scale) for r, t in zip(reqs, spread)]


def profile(args: argparse.Namespace, out: Path) -> Path:
    """`pdserve profile` with the servers' engine flags (benchmarks/harness/servers.py)."""
    cmd = [sys.executable, "-m", "pdserve", "profile", args.model, "--out", str(out), "--num-threads", "1",
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-num-batched-tokens", str(MAX_BATCHED), "--dtype", "float32"]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO)
    log(f"profile: {time.monotonic() - t0:.0f} s -> {out}")
    return out


def decisions(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=10).read().decode()
    pattern = r'^pdserve_disagg_decisions_total\{decision="(\w+)",reason="(\w+)"\} ([\d.e+-]+)$'
    return {f"{m.group(1)}:{m.group(2)}": float(m.group(3)) for m in re.finditer(pattern, text, re.M)}


def _ms(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "mean": None, "p50": None, "p90": None}
    a = np.array(xs) * 1000
    return {"n": len(xs), "mean": float(a.mean()), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def measure(mode: str, args: argparse.Namespace, plan: list[tuple[BenchRequest, float]], workdir: Path,
            latency_model: Path | None) -> dict:
    extra = ["--disagg", mode, "--disagg-threshold-tokens", str(args.threshold)]
    if mode == "cost":
        extra += ["--disagg-latency-model", str(latency_model), "--disagg-tpot-guard-ms", str(args.tpot_guard_ms)]
    server = start_pdserve("1p1d", args.model, workdir, extra, name=f"pdserve-{mode}")
    try:
        reqs, times = [r for r, _ in plan], [t for _, t in plan]
        records, duration = asyncio.run(run_workload(reqs, "http", server.url, times, temperature=0.0,
                                                     ignore_eos=True, return_timeline=True, progress=False))
        counted = decisions(server.url)
    finally:
        server.stop()
    return report(mode, records, duration, counted, args)


def report(mode: str, records: list[RequestRecord], duration: float, counted: dict, args: argparse.Namespace) -> dict:
    ok = [r for r in records if r.success and r.ttft is not None]
    short = [r for r in ok if r.prompt_len < args.short]
    tpot_s = args.slo_tpot_ms / 1000
    res = {"mode": mode, "completed": len(ok), "failed": len(records) - len(ok), "duration_s": duration,
           "ttft_short_ms": _ms([r.ttft for r in short]), "ttft_all_ms": _ms([r.ttft for r in ok]),
           "tpot_ms": _ms([r.tpot for r in ok if r.tpot is not None]), "decisions": counted,
           "prefilled_on_decode": sum(1 for r in ok if r.timeline and "route_local" in r.timeline),
           "slo": {}}
    for ttft_ms in args.slo_ttft_ms:
        att = attainment(records, ttft_ms / 1000, tpot_s)
        res["slo"][str(ttft_ms)] = {"attainment": att, "goodput_req_s": att * len(records) / duration}
    res["summary"] = {k: v for k, v in summarize(records, duration, None, tpot_s).items() if isinstance(v, (int, float))}
    s = res["ttft_short_ms"]
    log(f"{mode:<9} short TTFT mean {s['mean'] or 0:7.0f} ms p90 {s['p90'] or 0:7.0f} ms (n {s['n']})  all TTFT "
        f"p50 {res['ttft_all_ms']['p50'] or 0:6.0f} ms  TPOT p90 {res['tpot_ms']['p90'] or 0:6.1f} ms  "
        + "  ".join(f"SLO {k} ms: {v['attainment']:.0%}" for k, v in res["slo"].items()) + f"  {counted}")
    return res


def ratios(results: dict[str, dict]) -> dict:
    base = results.get("always")
    if base is None:
        return {}
    out = {}
    for mode, res in results.items():
        if mode == "always":
            continue
        b, m = base["ttft_short_ms"], res["ttft_short_ms"]
        out[mode] = {"short_ttft_mean_always_over_mode": b["mean"] / m["mean"] if b["mean"] and m["mean"] else None,
                     "goodput_mode_over_always": {k: (res["slo"][k]["goodput_req_s"] / v["goodput_req_s"]
                                                      if v["goodput_req_s"] else None) for k, v in base["slo"].items()}}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    p.add_argument("--modes", default="always,threshold,cost")
    p.add_argument("--requests", type=int, default=40)
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--rate", type=float, default=2.0, help="req/s the trace slice is compressed to")
    p.add_argument("--max-input", type=int, default=900)
    p.add_argument("--max-output", type=int, default=16)
    p.add_argument("--threshold", type=int, default=128, help="threshold mode: --disagg-threshold-tokens")
    p.add_argument("--tpot-guard-ms", type=float, default=100.0, help="cost mode: --disagg-tpot-guard-ms")
    p.add_argument("--short", type=int, default=128, help="a prompt with fewer tokens counts as short")
    p.add_argument("--slo-ttft-ms", type=lambda s: [float(x) for x in s.split(",")], default=[100.0, 250.0, 500.0, 1000.0])
    p.add_argument("--slo-tpot-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--latency-model", default=None, help="cost mode: this file instead of profiling first")
    p.add_argument("--out-dir", default=str(REPO / "results/conditional_disagg"))
    args = p.parse_args()
    if not (Path(args.model) / "config.json").is_file():
        from pdserve.common.loading.model_factory import make_model
        make_model(Path(args.model), "qwen3", "small", seed=0)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = workload(args, ModelConfig.from_dir(args.model).vocab_size)
    modes = [m for m in args.modes.split(",") if m]
    latency_model = Path(args.latency_model) if args.latency_model else None
    if "cost" in modes and latency_model is None:
        latency_model = profile(args, out_dir / "latency_model.json")
    results = {}
    with tempfile.TemporaryDirectory(prefix="conddisagg-") as tmp:
        for mode in modes:
            results[mode] = measure(mode, args, plan, Path(tmp), latency_model)
    lens = [r.prompt_len for r, _ in plan]
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "machine": {"cpu": platform.processor() or platform.machine(),
                                                                   "cores": os.cpu_count()},
           "config": {k: v for k, v in vars(args).items()},
           "workload": {"requests": len(plan), "mean_input": float(np.mean(lens)), "short_prompts": sum(n < args.short for n in lens),
                        "span_s": plan[-1][1], "mean_output": float(np.mean([r.output_len for r, _ in plan]))},
           "results": results, "ratios": ratios(results)}
    path = out_dir / "conditional_disagg.json"
    path.write_text(json.dumps(out, indent=2))
    log(f"ratios: {json.dumps(out['ratios'])}")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
