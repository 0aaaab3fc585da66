"""The measurements of benchmarks/routing/run.py and the workloads they run: (a) router
overhead, the router's ZMQ front end against the worker reached directly, on 1 colocated
worker (router_overhead); (b), (c) routing quality, `--routing prefix_load` against
`round_robin` on 2 prefill + 1 decode workers, each repeat on a fresh server, counters and
requests pooled per policy (compare_routing), with the Mooncake slice for (c)
(mooncake_slice) and the ideal and round-robin-bound hit rates (reuse). Each returns its
section of the report as plain JSON-ready data; the script owns the CLI and the printing.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
from pathlib import Path
from typing import Any

from benchmarks.routing.harness import (BLOCK_SIZE, COUNTERS, ROUTED, SEGMENTS, Server, Stream, WorkerClient,
                                        breakdown, check, drive)
from pdserve.common.config import EngineConfig
from pdserve.common.engine.model_runner import bytes_per_block
from pdserve.router.stats.latency import RequestRecord, phase_breakdown, summarize
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.workloads import BenchRequest, ideal_hit_rate, mooncake_workload, random_workload
from pdserve.router.client import AsyncClient

TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
TRACE_SCALE, TRACE_MAX_OUTPUT = 32, 8
SHORT_PROMPT_LEN, SHORT_MAX_TOKENS = 8, 2
KV_BYTES_CAP = 1 << 30  # per worker; beyond it the cache is capped (and may evict)
HIT_TARGET = 0.90  # prefix_load hit rate >= 90% of ideal
POLICIES = ("prefix_load", "round_robin")


# ---- workloads ------------------------------------------------------------------------
def mooncake_slice(start: int, n: int, rate: float, vocab: int, max_model_len: int,
                   seed: int) -> tuple[list[BenchRequest], dict[str, Any]]:
    """The scaled trace slice replayed at `rate` req/s, prompts cut to fit, and facts about it."""
    reqs = mooncake_workload(TRACE, n, TRACE_SCALE, vocab, start=start, max_output=TRACE_MAX_OUTPUT, seed=seed)
    if len(reqs) < 2:
        raise SystemExit(f"{TRACE}: fewer than 2 requests from line {start}")
    span = reqs[-1].arrival or 0.0  # trace seconds
    stretch = (len(reqs) - 1) / rate / span if span else 0.0  # n-1 gaps over the span -> `rate`
    cap = max_model_len - TRACE_MAX_OUTPUT - 1
    capped = sum(r.prompt_len > cap for r in reqs)
    for r in reqs:
        r.arrival, r.prompt_token_ids = (r.arrival or 0.0) * stretch, (r.prompt_token_ids or [])[:cap]
    with TRACE.open() as f:  # for reference: the trace's own 512-token blocks, one hash id each
        trace = [BenchRequest(json.loads(line)["hash_ids"], 1) for line in itertools.islice(f, start, start + n)]
    lens = [r.prompt_len for r in reqs]
    return reqs, {"trace": str(TRACE), "start": start, "requests": len(reqs), "trace_span_s": span,
                  "trace_rate_req_s": (len(reqs) - 1) / span if span else None, "replay_rate_req_s": rate,
                  "time_compression": 1 / stretch if stretch else None, "prompts_capped": capped,
                  "prompt_len_cap": cap, "mean_prompt_len": sum(lens) / len(lens), "max_prompt_len": max(lens),
                  "total_prompt_tokens": sum(lens), "mean_output_len": sum(r.output_len for r in reqs) / len(reqs),
                  "ideal_hit_rate_trace_hash_ids": ideal_hit_rate(trace, 1),
                  "output_cap": TRACE_MAX_OUTPUT, "block_size": BLOCK_SIZE}


def reuse(reqs: list[BenchRequest]) -> dict[str, Any]:
    """Ideal hit rate and the round-robin bound (2 infinite caches, requests dealt in turn)."""
    blocks = lambda rs: sum((r.prompt_len - 1) // BLOCK_SIZE for r in rs)  # cacheable blocks  # noqa: E731
    total, ideal = blocks(reqs), ideal_hit_rate(reqs, BLOCK_SIZE)
    rr = sum(ideal_hit_rate(reqs[k::2], BLOCK_SIZE) * blocks(reqs[k::2]) for k in range(2)) / total
    return {"ideal_hit_rate": ideal, "rr_bound_hit_rate": rr, "cacheable_blocks": total,
            "first_time_blocks": round(total * (1 - ideal)), "requests": len(reqs)}


def kv_blocks_for(reqs: list[BenchRequest], model: Path) -> int:
    """Blocks for every prompt + output at once plus warm-up (nothing evicted), up to KV_BYTES_CAP."""
    need = sum(-(-(r.prompt_len + r.output_len) // BLOCK_SIZE) for r in reqs) + 64
    return min(need, KV_BYTES_CAP // bytes_per_block(EngineConfig.build(model, block_size=BLOCK_SIZE)))


# ---- (a) router overhead ------------------------------------------------------------------
async def router_overhead(srv: Server, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    n_seq, n_conc, rounds = (40, 80, 2) if args.quick else (100, 240, 4)
    seeds = itertools.count(args.seed)  # a new prompt for every request
    short = lambda n: random_workload(n, SHORT_PROMPT_LEN, SHORT_MAX_TOKENS, 0.0, vocab, next(seeds))  # noqa: E731
    (worker,) = srv.workers("colocated").values()
    router, direct = AsyncClient(srv.info["zmq"]), WorkerClient(worker, srv.key)
    paths: dict[str, Stream] = {
        "router": lambda ids, n: router.stream(ids, max_tokens=n, temperature=0.0, ignore_eos=True,
                                               return_timeline=True),
        "direct": lambda ids, n: direct.stream(ids, n)}
    modes = {"sequential": (1, n_seq), f"concurrency {args.concurrency}": (args.concurrency, n_conc)}
    recs: dict[tuple[str, str], list[RequestRecord]] = {(m, p): [] for m in modes for p in paths}
    wall = dict.fromkeys(recs, 0.0)
    try:
        for p, s in paths.items():  # warm-up, not counted
            await drive(s, short(16), args.concurrency, f"(a) warm-up {p}")
        for rnd in range(rounds):
            print(f"(a) round {rnd + 1}/{rounds}", flush=True)
            for mode, (conc, n) in modes.items():
                for p in (list(paths) if rnd % 2 == 0 else list(paths)[::-1]):
                    got, seconds = await drive(paths[p], short(n), conc, f"(a) {mode} {p}")
                    recs[mode, p] += got
                    wall[mode, p] += seconds
    finally:
        await router.close()
        await direct.close()
    out: dict[str, Any] = {"setup": {"workers": "1 colocated", "prompt_len": SHORT_PROMPT_LEN,
                                     "max_tokens": SHORT_MAX_TOKENS, "rounds": rounds, "latency": "send -> last token",
                                     "requests_per_round": {"sequential": n_seq, "concurrent": n_conc}}}
    for mode in modes:
        row = out[mode] = {p: {**summarize(recs[mode, p], wall[mode, p]),
                               "breakdown_mean_ms": breakdown(recs[mode, p], SEGMENTS[p])} for p in paths}
        r, d = row["router"], row["direct"]
        row["added_latency_ms"] = {k: r[f"{k}_e2el_ms"] - d[f"{k}_e2el_ms"] for k in ("mean", "p50", "p99")}
        row["throughput_ratio_router_over_direct"] = r["request_throughput"] / d["request_throughput"]
    return out


# ---- (b), (c) routing quality -------------------------------------------------------------
Run = tuple[list[RequestRecord], float, dict[str, dict[str, int]], dict[str, float]]  # recs, wall, counter changes


async def _policy_run(srv: Server, reqs: list[BenchRequest], vocab: int, seed: int, concurrency: int | None,
                      desc: str) -> Run:
    (decode,) = srv.workers("decode").values()
    client = WorkerClient(decode, srv.key)
    try:  # warm-up: 2 unrelated prompts on each prefill worker, sent directly
        for k, address in enumerate(srv.workers("prefill").values()):
            await drive(lambda ids, n, a=address: client.stream(ids, n, a),
                        random_workload(2, 40, 2, 0.0, vocab, seed + 10_000 + k), 2, f"{desc} warm-up")
    finally:
        await client.close()
    workers0, routed0 = srv.counters()
    send_times = [r.arrival or 0.0 for r in reqs]  # all 0 in (b): `concurrency` in flight
    recs, wall = await run_workload(reqs, "zmq", srv.info["zmq"], send_times, max_concurrency=concurrency)
    check(recs, reqs, desc)
    workers1, routed1 = srv.counters()
    return (recs, wall, {w: {k: c[k] - workers0[w][k] for k in COUNTERS} for w, c in workers1.items()},
            {k: routed1[k] - routed0[k] for k in ROUTED})


def pooled(runs: list[Run], ideal: dict[str, Any]) -> dict[str, Any]:
    """Counters summed and requests pooled over the repeats of one policy."""
    recs = [r for run in runs for r in run[0]]
    per_worker = {w: {k: sum(run[2][w][k] for run in runs) for k in COUNTERS} for w in runs[0][2]}
    hits, queries, prefills = (sum(c[k] for c in per_worker.values()) for k in COUNTERS)
    computed = {w: c["prefix_query_blocks"] - c["prefix_hit_blocks"] for w, c in per_worker.items()}
    routed, routed_hits = (sum(run[3][k] for run in runs) for k in ROUTED)
    res = {"hit_rate": hits / max(1, queries), "hit_blocks": hits, "query_blocks": queries,
           "achieved_over_ideal": hits / max(1, queries) / ideal["ideal_hit_rate"] if ideal["ideal_hit_rate"] else None,
           # beyond each distinct prefix once: one prefix on both workers, or twice in one prefill batch
           "extra_blocks_computed": (queries - hits) / len(runs) - ideal["first_time_blocks"],
           "router_view_hit_rate": routed_hits / routed if routed else None,
           "prefill_share": {w: c["prefills"] / max(1, prefills) for w, c in per_worker.items()},
           "computed_block_share": {w: n / max(1, queries - hits) for w, n in computed.items()},
           **summarize(recs, sum(run[1] for run in runs)), **phase_breakdown(recs),
           "ttft_breakdown_mean_ms": breakdown(recs, SEGMENTS["ttft"])}
    if queries != ideal["cacheable_blocks"] * len(runs):  # e.g. a preempted prompt admitted (and counted) twice
        res["note"] = f"workers counted {queries} queried blocks, the workload has {ideal['cacheable_blocks'] * len(runs)}"
    return res


def compare_routing(part: str, reqs: list[BenchRequest], concurrency: int | None, model: Path,
                    args: argparse.Namespace, vocab: int, max_model_len: int, workdir: Path) -> dict[str, Any]:
    ideal, kv_blocks = reuse(reqs), kv_blocks_for(reqs, model)
    data: dict[str, list[Run]] = {p: [] for p in POLICIES}
    for rep in range(args.repeats):
        for policy in (POLICIES if rep % 2 == 0 else POLICIES[::-1]):  # AB BA: drift hits both alike
            desc = f"({part}) {policy} [{rep + 1}/{args.repeats}]"
            print(desc, flush=True)
            with Server(f"{part}-{policy}-{rep}", model, ["--prefill", "2", "--decode", "1"], policy, kv_blocks,
                        max_model_len, workdir) as srv:
                data[policy].append(asyncio.run(_policy_run(srv, reqs, vocab, args.seed, concurrency, desc)))
    runs = {policy: {**pooled(rd, ideal),
                     "per_repeat": [{k: pooled([r], ideal)[k] for k in ("hit_rate", "mean_ttft_ms", "request_throughput")}
                                    for r in rd],
                     "ttft_ms_per_request": [[round(1e3 * (r.ttft or 0.0), 2) for r in run[0]] for run in rd]}
            for policy, rd in data.items()}
    ratio = runs["prefix_load"]["achieved_over_ideal"] or 0.0
    ttft = {f"{p}_ms": runs[p]["mean_ttft_ms"] for p in POLICIES}
    targets = {"hit_rate_ge_90pct_ideal": {"achieved_over_ideal": ratio, "met": ratio >= HIT_TARGET},
               "ttft_below_round_robin": {**ttft, "met": ttft["prefix_load_ms"] < ttft["round_robin_ms"]}}
    return {**ideal, "repeats": args.repeats, "num_kv_blocks_per_worker": kv_blocks, "runs": runs, "targets": targets}
