"""pdserve against vLLM's CPU build on the machine it runs on, side by side in one run (issue 13).

    python benchmarks/vs_vllm.py --vllm-python /work/vllm-venv/bin/python
        [--configs colocated,1p1d] [--rates 1,3] [--num-prompts 60] [--skip-offline] [--skip-serving]
        [--crosscheck-rate 1] [--servers-up one|all] [--repeats 1] [--emulate-avx2]
        [--model DIR] [--dtype float32|bfloat16] [--out-dir results/vs_vllm]

Not part of CI. Without --vllm-python (or with one that cannot import vllm) the vLLM side is
skipped with a message saying so, and only pdserve is measured.

Model: the small qwen3 made by `pdserve make-model DIR --arch qwen3 --size small` (seed 0;
made under results/models/qwen3-small if missing), float32 on both (`--dtype bfloat16`: both engines in bf16, offline and served).

Offline: the offline_throughput.py workload (`--offline-prompts` random token-id prompts,
inputs 32-512, outputs 16-256, greedy, ignore_eos): pdserve's `LLM.generate` with 2 torch
threads (offline_throughput.py's own child, no overhead phase) and vLLM's `LLM.generate`
(benchmarks/vllm_offline.py in the vLLM venv), each in a fresh process, alternating
`--offline-repeats` times; tok/s = generated tokens / wall time of one `generate`.

Serving: by default (`--servers-up one`) each server is started for each rate it serves,
warmed up with two requests, given SETTLE_S, measured (`--repeats` points, each with fresh
prompts and send times) and stopped, so that it has the machine to itself: an idle
server is not idle enough (an idle vLLM still uses CPU between requests), and on 2 cores
whatever it takes shows in the measured server's tail latency. `--servers-up all` keeps
every server up through the sweep instead. Every point records
`other_cpu_s`, the CPU seconds the rest of the machine used (neither the server nor the
client), to judge how quiet it was. pdserve configs: `colocated` = one colocated worker
with 2 torch threads; `1p1d` = 1 prefill + 1 decode worker, 1 thread each. vLLM:
`python -m vllm.entrypoints.openai.api_server` with VLLM_CPU_OMP_THREADS_BIND=0-1,
VLLM_CPU_NUM_OF_RESERVED_CPU=0, VLLM_CPU_KVCACHE_SPACE=4 and libiomp5 preloaded. Both get
--max-model-len 1024 --max-num-seqs 64 --max-num-batched-tokens 2048. One client for all
(router/bench, HTTP backend: output tokens from pdserve's token ids, or from vLLM's text
chunks fitted to the final usage chunk). Each point: `--num-prompts` fresh random prompts
(exactly `--input-len` tokens in, `--output-len` out, ignore_eos, a new seed per point, the
same prompts and Poisson send times for every server); the servers take turns, the order
reversed at every point. SLOs: TTFT <= 1 s, TPOT <= 100 ms; goodput = requests meeting both
per second; goodput rate = the highest rate with >= 90% attainment (interpolated).

Client cross-check (`--crosscheck-rate R`): after the sweep, every server gets one more
point at R req/s from our client and then one from vLLM's own `vllm bench serve` (random
dataset, the same lengths, count and rate; its prompts are its own), back to back; both
clients' TTFT and TPOT land in results.json under serving._crosscheck.

AVX2 on an AVX-512 machine (`--emulate-avx2`): the machines this project targets have AVX2
only, and so does vLLM's choice of kernels there. The flag caps torch's ATen kernels, oneDNN
and MKL at AVX2 for both engines, builds pdserve's C kernels with -mno-avx512f, and makes
vLLM load `vllm._C_AVX2` (benchmarks/avx2_hook); results.json's host.isa says which ran. The
caches, clocks and memory are still the AVX-512 machine's.

Writes results.json and vs_vllm.png into --out-dir, server logs under logs/.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pdserve.common.config import ModelConfig  # noqa: E402
from pdserve.common.gc_tuning import freeze_startup_heap  # noqa: E402
from pdserve.router.bench.arrivals import arrival_times  # noqa: E402
from pdserve.router.stats.knee import goodput_knee  # noqa: E402
from pdserve.router.stats.latency import summarize  # noqa: E402
from pdserve.router.bench.runner import run_workload  # noqa: E402
from pdserve.router.bench.workloads import random_workload  # noqa: E402
from vs_vllm_plot import plot  # noqa: E402
from point_report import BASELINE_SUFFIX, baseline_ratios, log_point, median_point  # noqa: E402
from servers import (MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, PDSERVE_CONFIGS, VLLM_ENV, Server, emulate_avx2, log,  # noqa: E402
                     start_pdserve, start_vllm, tree_cpu_s, vllm_bench_serve, vllm_env, vllm_version)

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.100
POINT_TIMEOUT_S = 600.0
SETTLE_S = 3.0  # after a server's warm-up, before its point: its warm-up's after-work is done


# ---- offline ------------------------------------------------------------------------------

def offline(args: argparse.Namespace, model: str, vocab: int, tmp: Path) -> dict:
    from offline_throughput import kv_blocks_for, make_workload

    work = make_workload(args.offline_prompts, vocab, 0)
    wl = tmp / "offline_workload.json"
    wl.write_text(json.dumps({"model": model, "prompts": work.prompts, "output_lens": work.output_lens,
                              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                              "max_num_batched_tokens": MAX_BATCHED, "dtype": args.dtype}))
    runs: dict[str, list[dict]] = {"pdserve": [], "vllm": []}
    for rep in range(args.offline_repeats):
        order = ["pdserve", "vllm"] if rep % 2 == 0 else ["vllm", "pdserve"]
        for eng in order:
            out = tmp / f"offline_{eng}_{rep}.json"
            if eng == "pdserve":
                cmd = [sys.executable, str(REPO / "benchmarks" / "offline_throughput.py"), "--child", "ours",
                       "--child-out", str(out), "--model", model, "--num-prompts", str(args.offline_prompts),
                       "--seed", "0", "--overhead-steps", "0", "--dtype", args.dtype]
                env = dict(os.environ, PYTHONPATH=str(REPO))
            elif args.vllm_python:
                cmd = [args.vllm_python, str(REPO / "benchmarks" / "vllm_offline.py"), str(wl), str(out)]
                env = vllm_env(args.vllm_python)
            else:
                continue
            log(f"offline {eng} (run {rep + 1}/{args.offline_repeats})")
            with open(Path(args.out_dir) / "logs" / f"offline_{eng}_{rep}.log", "wb") as f:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)
            if done.returncode != 0:
                log(f"  {eng} offline run failed (exit {done.returncode}); see logs/offline_{eng}_{rep}.log")
                continue
            res = json.loads(out.read_text())
            res = res.get("throughput", res)
            runs[eng].append(res)
            log(f"  {eng}: {res['output_tokens']} tokens in {res['seconds']:.1f} s = {res['tokens_per_s']:.1f} tok/s")
    best = {e: sorted(r, key=lambda x: x["tokens_per_s"])[(len(r) - 1) // 2] if r else None for e, r in runs.items()}
    p, v = best["pdserve"], best["vllm"]
    return {"workload": {"num_prompts": args.offline_prompts, "input_len_range": [32, 512],
                         "output_len_range": [16, 256], "total_output_tokens": work.total_output,
                         "pdserve_num_kv_blocks": kv_blocks_for(work), "pdserve_threads": 2,
                         "dtype": args.dtype},
            "runs": runs, "pdserve": p, "vllm": v,
            "ratio_pdserve_over_vllm": p["tokens_per_s"] / v["tokens_per_s"] if p and v else None}


# ---- serving ------------------------------------------------------------------------------

def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent busy (all cores, since boot)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0) + getattr(t, "steal", 0.0)


def own_cpu_s() -> float:
    """CPU seconds of this process alone (the client; the servers are its children)."""
    t = psutil.Process().cpu_times()
    return t.user + t.system


def process_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of one process, without its children (pdserve: the router process)."""
    try:
        t = proc.cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def measure(server: Server, others: list[Server], reqs, times) -> dict:
    """One point against `server`. Besides the figures: the CPU seconds the server's
    process tree used, its top process alone per 1k streamed tokens (pdserve's router,
    vLLM's API server: `top_cpu_ms_per_1k_tokens`), those of every other server kept up
    (`idle_others_cpu_s`), and `other_cpu_s`, what the rest of the machine used (neither
    the server nor this client): how quiet the run was."""
    load0 = os.getloadavg()[0]
    top0 = process_cpu_s(server.ps)
    cpu0 = {s.name: tree_cpu_s(s.ps) for s in [server, *others]}
    busy0, mine0 = busy_cpu_s(), own_cpu_s()
    coro = run_workload(reqs, "http", server.url, times, None, 0.0, True, False, (), False)
    try:
        records, duration = asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))
    except asyncio.TimeoutError:
        return {"error": f"timed out after {POINT_TIMEOUT_S:.0f} s"}
    res = summarize(records, duration, SLO_TTFT_S, SLO_TPOT_S, (90, 99))
    cpu1 = {s.name: tree_cpu_s(s.ps) for s in [server, *others]}
    top_cpu = process_cpu_s(server.ps) - top0
    server_cpu = cpu1[server.name] - cpu0[server.name]
    client_cpu = own_cpu_s() - mine0
    out_tokens = sum(r.output_len for r in records if r.success)
    res.update(server_cpu_s=server_cpu, client_cpu_s=client_cpu, top_cpu_s=round(top_cpu, 3),
               top_cpu_ms_per_1k_tokens=round(top_cpu * 1e6 / out_tokens, 1) if out_tokens else None,
               other_cpu_s=round(busy_cpu_s() - busy0 - server_cpu - client_cpu, 2),
               idle_others_cpu_s={s.name: round(cpu1[s.name] - cpu0[s.name], 2) for s in others},
               loadavg_1m_before=load0, loadavg_1m_after=os.getloadavg()[0],
               errors=sorted({r.error for r in records if not r.success})[:3])
    return res


def server_names(args: argparse.Namespace) -> list[str]:
    ours = [f"pdserve-{c}" for c in args.configs.split(",")]
    base = [n + BASELINE_SUFFIX for n in ours] if getattr(args, "baseline", None) else []
    return ours + base + (["vllm"] if args.vllm_python else [])


def start_server(name: str, args: argparse.Namespace, model: str, vocab: int, logdir: Path) -> Server:
    """Start one server, warm it up with two requests (not counted), let it settle."""
    if name == "vllm":
        s = start_vllm(args.vllm_python, model, logdir, dtype=args.dtype)
    elif name.endswith(BASELINE_SUFFIX):
        cfg = name.removeprefix("pdserve-").removesuffix(BASELINE_SUFFIX)
        s = start_pdserve(cfg, model, logdir, repo=Path(args.baseline), name=name, dtype=args.dtype)
    else:
        s = start_pdserve(name.removeprefix("pdserve-"), model, logdir, dtype=args.dtype)
    try:
        warm = random_workload(2, args.input_len, args.output_len, 0.0, vocab, seed=99)
        recs, _ = asyncio.run(run_workload(warm, "http", s.url, [0.0, 0.0], None, 0.0, True, False, (), False))
        if not all(r.success for r in recs):
            raise RuntimeError(f"{s.name}: warm-up failed: {[r.error for r in recs]}")
        time.sleep(SETTLE_S)
    except BaseException:
        s.stop()
        raise
    return s


class Servers:
    """The servers of a run. `--servers-up one` (the default): a server is started for
    each rate it serves and stopped after, so it has the machine to itself; `all`: every
    server is started once and stays up through every point (faster; an idle server's
    activity then lands in another's point: see `idle_others_cpu_s`)."""

    def __init__(self, args: argparse.Namespace, model: str, vocab: int, logdir: Path, on_ready=None):
        self.args, self.model, self.vocab, self.logdir, self.on_ready = args, model, vocab, logdir, on_ready
        self.up: dict[str, Server] = {}

    def __enter__(self) -> Servers:
        if self.args.servers_up == "all":
            for name in server_names(self.args):
                self.up[name] = start_server(name, self.args, self.model, self.vocab, self.logdir)
            if self.on_ready:
                self.on_ready(list(self.up.values()))
        return self

    def __exit__(self, *exc) -> None:
        for s in self.up.values():
            s.stop()
        self.up.clear()

    @contextlib.contextmanager
    def serving(self, name: str) -> Iterator[tuple[Server, list[Server]]]:
        """`name`'s server, up, and the other servers up beside it."""
        if name in self.up:
            yield self.up[name], [o for o in self.up.values() if o.name != name]
            return
        s = start_server(name, self.args, self.model, self.vocab, self.logdir)
        try:
            if self.on_ready:
                self.on_ready([s])
            yield s, []
        finally:
            s.stop()


def serving(args: argparse.Namespace, model: str, vocab: int, logdir: Path, on_ready=None) -> dict:
    names = server_names(args)
    rates = [float(r) for r in args.rates.split(",")]
    points: dict[str, list[dict]] = {n: [] for n in names}
    commands: dict[str, str] = {}
    crosscheck = {}
    with Servers(args, model, vocab, logdir, on_ready) as servers:
        for i, rate in enumerate(rates):
            for name in (names if i % 2 == 0 else list(reversed(names))):
                with servers.serving(name) as (s, others):
                    commands[name] = s.cmd  # type: ignore[attr-defined]
                    for rep in range(args.repeats):
                        k = i * args.repeats + rep  # the same prompts and send times for every server
                        reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=100 + k)
                        times = arrival_times(args.num_prompts, rate, 1.0, seed=k)
                        log(f"rate {rate} req/s: {name}" + (f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else ""))
                        res = measure(s, others, reqs, times)
                        res.update(request_rate=rate, repeat=rep)
                        points[name].append(res)
                        log_point(name, res, args.num_prompts)
        if args.crosscheck_rate and args.vllm_python:
            i = len(rates) * args.repeats  # seeds no sweep point used
            for name in (names if i % 2 == 0 else list(reversed(names))):
                log(f"crosscheck at {args.crosscheck_rate} req/s: {name}, pdserve bench then vllm bench serve")
                reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=100 + i)
                times = arrival_times(args.num_prompts, args.crosscheck_rate, 1.0, seed=i)
                with servers.serving(name) as (s, others):
                    ours = measure(s, others, reqs, times)
                    theirs = vllm_bench_serve(args.vllm_python, s, model, logdir, input_len=args.input_len,
                                              output_len=args.output_len, num_prompts=args.num_prompts,
                                              rate=args.crosscheck_rate, seed=i, timeout_s=POINT_TIMEOUT_S + 300)
                crosscheck[name] = {"pdserve_bench": ours, "vllm_bench_serve": theirs}
                if "error" not in ours and "error" not in theirs:
                    log(f"  {name:<18} TTFT mean {ours['mean_ttft_ms']:.0f} vs {theirs['mean_ttft_ms']:.0f} ms, "
                        f"TPOT mean {ours['mean_tpot_ms']:.1f} vs {theirs['mean_tpot_ms']:.1f} ms "
                        f"(pdserve bench vs vllm bench serve)")
    out: dict = {"_crosscheck": crosscheck} if crosscheck else {}
    for name in names:
        sweep = [median_point(r, [p for p in points[name] if p["request_rate"] == r]) for r in rates]
        ok = [p for p in sweep if "error" not in p]
        out[name] = {"command": commands.get(name), "sweep": sweep, "points": points[name],
                     "goodput_knee": goodput_knee([p["request_rate"] for p in ok], [p["slo_attainment"] for p in ok]).as_json()}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (e.g. /work/vllm-venv/bin/python)")
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    p.add_argument("--out-dir", default=str(REPO / "results/vs_vllm"))
    p.add_argument("--configs", default="colocated,1p1d", help=f"pdserve configs, of {','.join(PDSERVE_CONFIGS)}")
    p.add_argument("--rates", default="1,3")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--repeats", type=int, default=1,
                   help="points per rate and server, each with fresh prompts and send times; the sweep "
                        "reports each metric's median over them (p99 of 60 requests is the worst one or two)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--offline-repeats", type=int, default=1)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="both engines' dtype, offline and served")
    p.add_argument("--crosscheck-rate", type=float, default=None,
                   help="after the sweep, one more point at this rate per server with our client and then "
                        "with `vllm bench serve` (needs --vllm-python), to check the two clients agree")
    p.add_argument("--servers-up", choices=("one", "all"), default="one",
                   help="one: each server is started for its point and stopped after, alone on the machine "
                        "(default); all: every server stays up through the whole sweep")
    p.add_argument("--emulate-avx2", action="store_true",
                   help="run this AVX-512 machine as an AVX2 one, for every engine: torch, oneDNN and MKL capped at AVX2, "
                        "pdserve's C kernels built with -mno-avx512f, vLLM's AVX2 kernels (benchmarks/servers.py AVX2_ENV)")
    p.add_argument("--baseline", default=None,
                   help="a checkout of another pdserve commit (e.g. a `git worktree`): its servers "
                        "(`pdserve-CONFIG@baseline`) serve every point too, in the same alternation")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--py-spy-pid-file", default=None,
                   help="write the worker pids of the servers up here once they are warm (for profiling; "
                        "with --servers-up one, rewritten as each server starts)")
    args = p.parse_args()
    isa = {"emulated_avx2": emulate_avx2()} if args.emulate_avx2 else {"native": "as the CPU allows"}
    freeze_startup_heap()  # this process is the load generator: no 100 ms collections mid-run
    t0 = time.monotonic()
    out_dir = Path(args.out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    vver = vllm_version(args.vllm_python)
    if args.vllm_python and vver is None:
        log(f"SKIPPING vLLM: {args.vllm_python} cannot import vllm (with VLLM_TARGET_DEVICE=cpu)")
        args.vllm_python = None
    elif not args.vllm_python:
        log("SKIPPING vLLM: no --vllm-python given; measuring pdserve only")
    if not (Path(args.model) / "config.json").exists():
        from pdserve.common.loading.model_factory import make_model
        log(f"making the small qwen3 model in {args.model}")
        make_model(args.model, "qwen3", "small", seed=0)
    vocab = ModelConfig.from_dir(args.model).vocab_size
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "pdserve_commit": git.stdout.strip(), "vllm_version": vver, "vllm_env": VLLM_ENV | {"LD_PRELOAD": "libiomp5.so"},
                    "model": args.model, "slo": {"ttft_ms": SLO_TTFT_S * 1000, "tpot_ms": SLO_TPOT_S * 1000},
                    "host": {"cpus": os.cpu_count(), "isa": isa, "platform": platform.platform(), "loadavg_at_start": os.getloadavg()}}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_offline:
            report["offline"] = offline(args, args.model, vocab, Path(tmp))
            (out_dir / "results.json").write_text(json.dumps(report, indent=2))
        if not args.skip_serving:
            def on_ready(servers: list[Server]) -> None:
                if args.py_spy_pid_file:
                    Path(args.py_spy_pid_file).write_text(json.dumps({s.name: s.worker_pids for s in servers}))
            report["serving_workload"] = {"num_prompts": args.num_prompts, "input_len": args.input_len,
                                          "output_len": args.output_len, "arrivals": "Poisson", "rates": args.rates,
                                          "prompts": "fresh random token ids per point, same for every server"}
            report["serving"] = serving(args, args.model, vocab, out_dir / "logs", on_ready)
    if args.baseline and report.get("serving"):
        report["baseline_ratios"] = baseline_ratios(report["serving"])
    report["host"]["loadavg_at_end"] = os.getloadavg()
    report["runtime_s"] = time.monotonic() - t0
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "vs_vllm.png", (SLO_TTFT_S, SLO_TPOT_S))
    log(f"done in {report['runtime_s'] / 60:.1f} min; wrote {out_dir}/results.json and vs_vllm.png")
    off = report.get("offline")
    if off:
        print(f"offline tok/s: pdserve {off['pdserve']['tokens_per_s']:.1f}" if off["pdserve"] else
              "offline pdserve: failed")
        if off["vllm"]:
            print(f"offline tok/s: vllm {off['vllm']['tokens_per_s']:.1f}; ratio pdserve/vllm {off['ratio_pdserve_over_vllm']:.2f}")
    for name, r in report.get("serving", {}).items():
        if name == "_crosscheck":
            continue
        for pt in r["sweep"]:
            if "error" in pt:
                print(f"{name:<18} rate {pt['request_rate']}: {pt['error']}")
                continue
            rep = f" (median of {pt['repeats']})" if pt["repeats"] > 1 else ""
            print(f"{name:<18} rate {pt['request_rate']}{rep}: TTFT mean/p99 {pt['mean_ttft_ms']:.0f}/{pt['p99_ttft_ms']:.0f} ms, "
                  f"TPOT mean/p99 {pt['mean_tpot_ms']:.1f}/{pt['p99_tpot_ms']:.1f} ms, attainment "
                  f"{pt['slo_attainment']:.0%}, goodput {pt['request_goodput']:.2f} req/s")
        print(f"{name:<18} goodput knee: {r['goodput_knee']['text']}")
    for name, rows in report.get("baseline_ratios", {}).items():
        for row in rows:
            cpu = row.get("top_cpu_ms_per_1k_tokens_over_baseline")
            print(f"{name} rate {row['request_rate']}: over the baseline checkout, router CPU per 1k tokens "
                  f"{'-' if cpu is None else format(cpu, '.3f')}, TTFT mean/p99 "
                  f"{row['mean_ttft_ms_over_baseline']:.3f}/{row['p99_ttft_ms_over_baseline']:.3f}, TPOT mean/p99 "
                  f"{row['mean_tpot_ms_over_baseline']:.3f}/{row['p99_tpot_ms_over_baseline']:.3f}")
            if "mean_tpot_ms_over_vllm" in row:
                print(f"  over vLLM: this TTFT/TPOT mean {row['mean_ttft_ms_over_vllm']:.3f}/"
                      f"{row['mean_tpot_ms_over_vllm']:.3f}, baseline {row['baseline_mean_ttft_ms_over_vllm']:.3f}/"
                      f"{row['baseline_mean_tpot_ms_over_vllm']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
