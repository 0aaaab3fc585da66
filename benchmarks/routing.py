"""Router overhead and routing quality, measured side by side in one run.

    python benchmarks/routing.py [--model DIR] [--out results/routing.json] [--quick]
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
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import zmq  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from any directory

from benchmarks.offline_throughput import ensure_model  # noqa: E402
from common import messages as wire  # noqa: E402
from common.config import EngineConfig, ModelConfig  # noqa: E402
from common.messages import ErrorReply, GenerateRequest, Sampling, StatusRequest, TokenOutput, WorkerStatus  # noqa: E402
from common.model_runner import bytes_per_block  # noqa: E402
from common.transport import Client  # noqa: E402
from router.bench.metrics import RequestRecord, phase_breakdown, summarize  # noqa: E402
from router.bench.runner import run_workload  # noqa: E402
from router.bench.workloads import (BenchRequest, ideal_hit_rate, mooncake_workload, random_workload,  # noqa: E402
                                    shared_prefix_workload)
from router.client import AsyncClient  # noqa: E402

BLOCK_SIZE = 16
TINY_MODEL = REPO / "results" / "models" / "qwen3-tiny"
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
TRACE_SCALE, TRACE_MAX_OUTPUT = 32, 8
SHARED = {"groups": 8, "system_len": 112, "question_len": 16, "output_len": 4}
SHORT_PROMPT_LEN, SHORT_MAX_TOKENS = 8, 2
KV_BYTES_CAP = 1 << 30  # per worker; beyond it the cache is capped (and may evict)
READY_TIMEOUT_S, STOP_TIMEOUT_S, RUN_TIMEOUT_S = 240.0, 30.0, 900.0
HIT_TARGET = 0.90  # prefix_load hit rate >= 90% of ideal
POLICIES = ("prefix_load", "round_robin")
COUNTERS = ("prefix_hit_blocks", "prefix_query_blocks", "prefills")
ROUTED = ("pdserve_routed_prompt_blocks_total", "pdserve_routed_prefix_hit_blocks_total")


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


# ---- servers --------------------------------------------------------------------------
class Server:
    """One `pdserve serve` (router + workers) with a ready file. Owns the process, its log
    and its workers; leaving the `with` block leaves none of them running."""

    def __init__(self, name: str, model: Path, layout: list[str], routing: str, num_kv_blocks: int,
                 max_model_len: int, workdir: Path) -> None:
        self.name, self.ready_file, self.log_path = name, workdir / f"{name}.ready.json", workdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "common.cli", "serve", str(model), *layout, "--routing", routing,
                    "--http-port", "0", "--zmq-port", "0", "--ready-file", str(self.ready_file),
                    "--num-kv-blocks", str(num_kv_blocks), "--max-model-len", str(max_model_len),
                    "--block-size", str(BLOCK_SIZE), "--num-threads", "1"]
        self.info: dict[str, Any] = {}

    def __enter__(self) -> "Server":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not self.ready_file.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
                    raise RuntimeError(f"server {self.name} exited (code {self.proc.returncode}) or was not "
                                       f"ready in {READY_TIMEOUT_S:.0f} s:\n{tail}")
                time.sleep(0.1)
            self.info = json.loads(self.ready_file.read_text())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the router stops its workers, then exits
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # workers run in their own sessions: kill each by pid
                for pid in [self.proc.pid, *(w["pid"] for w in self.info.get("workers", {}).values())]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()

    def workers(self, role: str) -> dict[str, str]:
        """name -> address of the workers with this role, sorted by name."""
        return {n: w["address"] for n, w in sorted(self.info["workers"].items()) if w["role"] == role}

    def counters(self) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
        """Each prefill worker's COUNTERS (its WorkerStatus) and the router's ROUTED (/metrics)."""
        from prometheus_client.parser import text_string_to_metric_families
        ctx, workers = zmq.Context(), {}
        try:
            for name, address in self.workers("prefill").items():
                c = Client(ctx, address)
                try:
                    c.send(StatusRequest())
                    msg = c.recv(timeout_ms=30_000).msg
                finally:
                    c.close()
                if not isinstance(msg, WorkerStatus):
                    raise RuntimeError(f"worker {name} answered a status request with {msg!r}")
                workers[name] = {k: msg.counters.get(k, 0) for k in COUNTERS}
        finally:
            ctx.term()
        text = urllib.request.urlopen(self.info["http"].removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        return workers, {k: samples.get(k, 0.0) for k in ROUTED}


# ---- clients, the closed-loop driver, timeline breakdown ---------------------------------
class WorkerClient(AsyncClient):
    """Talks to a decode or colocated worker directly with GenerateRequest, as the router
    does; reuses AsyncClient's socket and reply demultiplexing (workers reply one frame)."""

    async def stream(self, ids: list[int], max_tokens: int,  # type: ignore[override]
                     prefill_addr: str = "") -> AsyncIterator[TokenOutput]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = uuid.uuid4().hex
        q = self._queues[rid] = asyncio.Queue()
        try:
            req = GenerateRequest(rid, ids, Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                  prefill_addr, return_timeline=True, timeline={"arrival": time.time()})
            await self.sock.send(wire.encode(req))
            while True:
                msg = await q.get()
                if isinstance(msg, ErrorReply):
                    raise RuntimeError(f"worker error ({msg.code}): {msg.message}")
                yield msg
                if msg.finished:
                    return
        finally:
            self._queues.pop(rid, None)


Stream = Callable[[list[int], int], AsyncIterator[TokenOutput]]


def check(recs: list[RequestRecord], reqs: list[BenchRequest], desc: str) -> None:
    bad = [i for i, (r, q) in enumerate(zip(recs, reqs)) if not r.success or r.output_len != q.output_len]
    if bad:
        r = recs[bad[0]]
        raise RuntimeError(f"{desc}: {len(bad)} of {len(recs)} requests failed or came back short; request "
                           f"{bad[0]}: {r.error or f'{r.output_len} of {reqs[bad[0]].output_len} tokens'}")


async def drive(stream: Stream, reqs: list[BenchRequest], concurrency: int, desc: str
                ) -> tuple[list[RequestRecord], float]:
    """Closed loop, `concurrency` requests in flight; the records and the wall seconds."""
    recs = [RequestRecord(0.0, prompt_len=r.prompt_len) for r in reqs]
    todo = iter(range(len(reqs)))

    async def loop() -> None:
        for i in todo:
            rec = recs[i]
            rec.send_time = time.perf_counter()
            async for out in stream(reqs[i].prompt_token_ids or [], reqs[i].output_len):
                rec.token_times += [time.perf_counter()] * len(out.token_ids)
                if out.finished:
                    rec.timeline = out.timeline

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(loop() for _ in range(concurrency))), RUN_TIMEOUT_S)
    wall = time.perf_counter() - start
    check(recs, reqs, desc)
    return recs, wall


# (segment, from stamp, to stamp); "send", "recv_first", "recv" are the client's, the rest the server's
SEGMENTS = {
    "router": (("client->router", "send", "arrival"), ("router: check, hash, route", "arrival", "routed"),
               ("router->worker", "routed", "decode_arrival"), ("worker", "decode_arrival", "finish"),
               ("worker->router", "finish", "router_done"), ("router->client", "router_done", "recv")),
    "direct": (("client->worker", "send", "decode_arrival"), ("worker", "decode_arrival", "finish"),
               ("worker->client", "finish", "recv")),
    "ttft": (("client->router", "send", "arrival"), ("router", "arrival", "routed"),  # (b), (c): router, D, P
             ("router->D", "routed", "decode_arrival"), ("D reserve", "decode_arrival", "decode_reserved"),
             ("D->P", "decode_reserved", "prefill_queued"), ("P queue", "prefill_queued", "prefill_start"),
             ("P prefill", "prefill_start", "prefill_end"), ("P->D KVReady", "prefill_end", "kv_ready"),
             ("D->router->client", "kv_ready", "recv_first")),
}


def breakdown(recs: list[RequestRecord], segments: tuple[tuple[str, str, str], ...]) -> dict[str, float | None]:
    """Mean ms of each segment of a request's path, over the records that have both stamps."""
    # the client stamps perf_counter, the server time.time(); NTP slews both alike on
    # Linux, so their offset stays put unless the wall clock is stepped
    off = time.time() - time.perf_counter()
    out = {}
    for name, a, b in segments:
        gaps = []
        for r in recs:
            t = dict(r.timeline or {}, send=r.send_time + off, recv_first=r.token_times[0] + off,
                     recv=r.token_times[-1] + off)
            if a in t and b in t:
                gaps.append(t[b] - t[a])
        out[name] = 1e3 * sum(gaps) / len(gaps) if gaps else None
    return out


# ---- (a) router overhead ------------------------------------------------------------------
async def _overhead(srv: Server, vocab: int, args: argparse.Namespace) -> dict[str, Any]:
    n_seq, n_conc, rounds = (40, 80, 2) if args.quick else (100, 240, 4)
    seeds = itertools.count(args.seed)  # a new prompt for every request
    short = lambda n: random_workload(n, SHORT_PROMPT_LEN, SHORT_MAX_TOKENS, 0.0, vocab, next(seeds))  # noqa: E731
    (worker,) = srv.workers("colocated").values()
    router, direct = AsyncClient(srv.info["zmq"]), WorkerClient(worker)
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
    client = WorkerClient(decode)
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
    if args.model is None and not (TINY_MODEL / "model.safetensors").is_file():
        from common.model_factory import make_model  # ensure_model defaults to the small model: far slower here
        make_model(TINY_MODEL, "qwen3", "tiny", seed=0)
    model = ensure_model(args.model or str(TINY_MODEL))
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
            report["overhead"] = asyncio.run(_overhead(srv, vocab, args))
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
