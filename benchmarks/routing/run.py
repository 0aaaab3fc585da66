"""Router overhead and routing quality, measured side by side in one run.

    python -m benchmarks.routing.run [--model DIR] [--out results/routing.json] [--quick]
        [--concurrency 8] [--trace-requests 200] [--trace-start 0] [--trace-rate 8]
        [--parts a,b,c] [--repeats 1] [--seed 0]

Each measurement gets a fresh `pdserve serve` (--num-threads 1 per worker, --block-size
16, KV blocks for the whole workload up to 1 GiB, so nothing is evicted), stopped with
SIGTERM even on error or Ctrl-C. Default model: the tiny qwen3.

(a) Router overhead, 1 colocated worker: short requests (8 random token ids, max_tokens=2)
through the router's ZMQ front end or straight to the worker (the GenerateRequest the
router sends), sequentially and at --concurrency, one closed-loop driver for both, in
ABAB / BABA rounds. Latency = send -> last token; where the time goes = mean gaps
between the client's stamps and the server's timeline.

(b) Shared prefix (router.bench's shared_prefix_workload: 8 system prompts of 112 tokens x
32 questions of 16 tokens, max_tokens=4, --concurrency in flight) and (c) Mooncake replay
(its mooncake_workload: trace lengths / 32, 512-token hash blocks -> 16-token blocks, at
most 8 output tokens; prompts cut to fit max_model_len and time compressed to a mean
--trace-rate req/s here, open loop; for reference also the ideal over the trace's hash
ids), each on 2 prefill + 1 decode workers with
`--routing prefix_load` and `round_robin`, --repeats times in AB BA order, pooled. Each
prefill worker first prefills 2 unrelated prompts. Hit rate = change of the prefill
workers' prefix_hit_blocks / prefix_query_blocks (cacheable blocks: full, without the
last token); router view = pdserve_routed_prefix_hit_blocks / routed_prompt_blocks (the
router notes a routed prompt's blocks on its worker at once, so it may count a hit on a
prompt still being prefilled). Ideal = ideal_hit_rate in send order; rr bound = the same
with a cache per prefill worker, requests dealt in turn; extra = blocks computed beyond
each distinct prefix once. TTFT = send -> first token, split at every timeline stamp.

Layout: this script (CLI, orchestration, report); benchmarks/routing/experiments.py (the
measurements (a), (b), (c) and their workloads); benchmarks/routing/harness.py (the server
process, the direct worker client, the closed-loop driver, the timeline breakdown).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from benchmarks.harness.paths import REPO

from benchmarks.harness.models import ensure_model
from benchmarks.routing.experiments import compare_routing, mooncake_slice, router_overhead
from benchmarks.routing.harness import BLOCK_SIZE, Server
from pdserve.common.config import ModelConfig
from pdserve.router.bench.workloads import shared_prefix_workload

SHARED = {"groups": 8, "system_len": 112, "question_len": 16, "output_len": 4}


# ---- report and main ----------------------------------------------------------------------
def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def print_report(rep: dict[str, Any]) -> None:
    if "overhead" in rep:
        print("\n(a) router overhead, 1 colocated worker, 8-token prompts, max_tokens=2 (latency = E2E, ms)")
        print(f"{'mode':<16}{'path':<8}{'req/s':>9}{'p50':>9}{'p99':>9}{'mean':>9}")
    for mode, row in rep.get("overhead", {}).items():
        if mode == "setup":
            continue
        for p in ("direct", "router"):
            r = row[p]
            print(f"{mode:<16}{p:<8}{r['request_throughput']:>9.1f}{r['p50_e2el_ms']:>9.2f}"
                  f"{r['p99_e2el_ms']:>9.2f}{r['mean_e2el_ms']:>9.2f}")
        for p in ("direct", "router"):
            parts = ", ".join(f"{k} {fmt(v, '.2f')}" for k, v in row[p]["breakdown_mean_ms"].items())
            print(f"{'':<16}{p} path, mean ms: {parts}")
        a = row["added_latency_ms"]
        print(f"{'':<16}router adds p50 {a['p50']:+.2f} ms, p99 {a['p99']:+.2f} ms; "
              f"throughput router/direct {row['throughput_ratio_router_over_direct']:.3f}")
    for key, title in (("shared_prefix", "(b) shared prefix"), ("mooncake", "(c) mooncake replay")):
        if key not in rep:
            continue
        sec = rep[key]
        print(f"\n{title}: {sec['requests']} requests, 2 prefill + 1 decode; "
              f"ideal hit rate {sec['ideal_hit_rate']:.3f}, round-robin bound {sec['rr_bound_hit_rate']:.3f}")
        print(f"{'run':<13}{'hit rate':>9}{'/ideal':>8}{'router':>8}{'extra':>7}{'P0 req':>8}{'P0 work':>8}"
              f"{'TTFT mean':>10}{'p50':>8}{'p99':>8}{'prefill':>9}{'req/s':>7}")
        for name, r in sec["runs"].items():
            share, work = (next(iter(r[k].values())) for k in ("prefill_share", "computed_block_share"))
            print(f"{name:<13}{r['hit_rate']:>9.3f}{fmt(r['achieved_over_ideal'], '.3f'):>8}"
                  f"{fmt(r['router_view_hit_rate'], '.3f'):>8}{r['extra_blocks_computed']:>7.0f}{share:>8.2f}"
                  f"{work:>8.2f}{r['mean_ttft_ms']:>10.1f}{r['p50_ttft_ms']:>8.1f}{r['p99_ttft_ms']:>8.1f}"
                  f"{fmt(r.get('mean_prefill_ms'), '.1f'):>9}{r['request_throughput']:>7.1f}")
        for name, r in sec["runs"].items():
            if len(r["per_repeat"]) > 1:
                print(f"  per repeat {name}: " + ", ".join(
                    f"hit {x['hit_rate']:.3f} TTFT {x['mean_ttft_ms']:.1f} ms" for x in r["per_repeat"]))
            print(f"  TTFT breakdown {name}, mean ms: "
                  + ", ".join(f"{k} {fmt(v, '.1f')}" for k, v in r["ttft_breakdown_mean_ms"].items()))
        print("  hit rate: prefill workers' counters; router: the router's own view at routing time; extra: "
              "blocks computed beyond once per distinct prefix;\n  P0 req / P0 work: prefill-0's share of "
              "requests / of computed blocks; TTFT and prefill (compute, from the timeline) in ms")
        for t, v in sec["targets"].items():
            values = ", ".join(f"{k} {x:.3f}" for k, x in v.items() if k != "met")
            print(f"  target {t}: {'met' if v['met'] else 'NOT met'} ({values})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HuggingFace-format model dir (default: make the tiny qwen3 model)")
    ap.add_argument("--out", default=str(REPO / "results" / "routing.json"))
    ap.add_argument("--quick", action="store_true", help="fewer requests everywhere (a smoke run)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight in (a) and (b)")
    ap.add_argument("--trace-requests", type=int, default=200)
    ap.add_argument("--trace-start", type=int, default=0, help="first trace line of the slice")
    ap.add_argument("--trace-rate", type=float, default=8.0, help="(c) replay rate, req/s")
    ap.add_argument("--parts", default="a,b,c", help="which parts to run, e.g. b,c")
    ap.add_argument("--repeats", type=int, default=1, help="(b), (c): runs per policy, each on a fresh server")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    parts = set(args.parts.split(","))
    if min(args.concurrency, args.repeats) < 1 or args.trace_requests < 2 or args.trace_rate <= 0 \
            or not parts <= {"a", "b", "c"}:
        ap.error("need --concurrency and --repeats >= 1, --trace-requests >= 2, --trace-rate > 0, --parts from a,b,c")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # unwind like Ctrl-C: every server is stopped
    try:
        run(args, parts)
    except KeyboardInterrupt:
        sys.exit("interrupted; every server this run started has been stopped")


def run(args: argparse.Namespace, parts: set[str]) -> None:
    t_start, load_at_start = time.perf_counter(), os.getloadavg()
    model = ensure_model(args.model, size="tiny")  # the small model is far slower here
    cfg = ModelConfig.from_dir(model)
    vocab, max_model_len = cfg.vocab_size, min(2048, cfg.max_position_embeddings)
    workdir = Path(tempfile.mkdtemp(prefix="pdserve-routing-"))
    report: dict[str, Any] = {"config": {"model": str(model), "seed": args.seed, "quick": args.quick,
                                         "concurrency": args.concurrency, "block_size": BLOCK_SIZE,
                                         "max_model_len": max_model_len, "threads_per_worker": 1,
                                         "kv_transfer": "shm (auto on cpu)", "server_logs": str(workdir)}}
    common = (model, args, vocab, max_model_len, workdir)
    if "a" in parts:
        with Server("overhead", model, ["--colocated", "1"], "prefix_load", 256, max_model_len, workdir) as srv:
            report["overhead"] = asyncio.run(router_overhead(srv, vocab, args))
    if "b" in parts:
        per_group = 12 if args.quick else 32
        reqs = shared_prefix_workload(prompts_per_group=per_group, vocab=vocab, seed=args.seed, **SHARED)
        report["shared_prefix"] = {"setup": {**SHARED, "prompts_per_group": per_group, "concurrency": args.concurrency},
                                   **compare_routing("b", reqs, args.concurrency, *common)}
    if "c" in parts:
        n = min(args.trace_requests, 60) if args.quick else args.trace_requests
        reqs, facts = mooncake_slice(args.trace_start, n, args.trace_rate, vocab, max_model_len, args.seed)
        report["mooncake"] = {"setup": facts, **compare_routing("c", reqs, None, *common)}
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    report["runtime_s"] = time.perf_counter() - t_start
    report["machine"] = {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
                         "cpu_count": os.cpu_count(), "load_avg_1_5_15_min_at_start": load_at_start,
                         "load_avg_1_5_15_min_at_end": os.getloadavg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print_report(report)
    print(f"\nruntime {report['runtime_s']:.0f} s; wrote {out}")


if __name__ == "__main__":
    main()
