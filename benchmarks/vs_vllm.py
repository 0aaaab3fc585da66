"""pdserve against vLLM's CPU build on this machine, side by side in one run (issue 13).

    python benchmarks/vs_vllm.py --vllm-python /work/vllm-venv/bin/python
        [--configs colocated,1p1d] [--rates 1,3] [--num-prompts 60] [--skip-offline] [--skip-serving]
        [--crosscheck-rate 1]
        [--model DIR] [--out-dir results/vs_vllm]

Not part of CI. Without --vllm-python (or with one that cannot import vllm) the vLLM side is
skipped with a message saying so, and only pdserve is measured.

Model: the small qwen3 made by `pdserve make-model DIR --arch qwen3 --size small` (seed 0;
made under results/models/qwen3-small if missing), float32 on both.

Offline: the offline_throughput.py workload (`--offline-prompts` random token-id prompts,
inputs 32-512, outputs 16-256, greedy, ignore_eos): pdserve's `LLM.generate` with 2 torch
threads (offline_throughput.py's own child, no overhead phase) and vLLM's `LLM.generate`
(benchmarks/vllm_offline.py in the vLLM venv), each in a fresh process, alternating
`--offline-repeats` times; tok/s = generated tokens / wall time of one `generate`.

Serving: every server is started once and stays up (an idle one takes ~no CPU; the CPU
seconds each server's process tree used during every other server's point are recorded
as `idle_others_cpu_s` to check that). pdserve configs: `colocated` = one colocated worker
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

Writes results.json and vs_vllm.png into --out-dir, server logs under logs/.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a plain script from any directory
sys.path.insert(0, str(Path(__file__).resolve().parent))

import psutil  # noqa: E402

from common.config import ModelConfig  # noqa: E402
from router.bench.arrivals import arrival_times  # noqa: E402
from router.bench.metrics import goodput_rate, summarize  # noqa: E402
from router.bench.runner import run_workload  # noqa: E402
from router.bench.workloads import random_workload  # noqa: E402

SLO_TTFT_S, SLO_TPOT_S = 1.0, 0.100
MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_BATCHED = 1024, 64, 2048
POINT_TIMEOUT_S = 600.0
PDSERVE_CONFIGS = {
    "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1", "--num-threads", "2"],
    "1p1d": ["--prefill", "1", "--decode", "1", "--num-threads", "1"],
}
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vllm_env(vllm_python: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_ENV)
    iomp = Path(vllm_python).resolve().parents[1] / "lib" / "libiomp5.so"
    if not iomp.exists():  # the venv's python may be a symlink out of the venv
        iomp = Path(vllm_python).parents[1] / "lib" / "libiomp5.so"
    if iomp.exists():
        env["LD_PRELOAD"] = str(iomp)
    return env


def vllm_version(vllm_python: str | None) -> str | None:
    if not vllm_python:
        return None
    try:
        out = subprocess.run([vllm_python, "-c", "import vllm; print(vllm.__version__)"], env=vllm_env(vllm_python),
                             capture_output=True, text=True, timeout=300)
        return out.stdout.strip().splitlines()[-1] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        return None


def tree_cpu_s(proc: psutil.Process) -> float:
    """CPU seconds of a process and its live descendants."""
    total = 0.0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


# ---- servers ------------------------------------------------------------------------------

class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path):
        self.name, self.log_path = name, log_path
        self.t0 = time.monotonic()
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.url = ""
        self.worker_pids: list[int] = []

    def fail_if_dead(self, timeout_s: float) -> None:
        if self.proc.poll() is not None or time.monotonic() - self.t0 > timeout_s:
            self.stop()
            raise RuntimeError(f"{self.name}: server did not start:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        """SIGTERM to the server, then (only if it does not stop) SIGKILL to its own process tree."""
        if self.proc.poll() is not None:
            return
        try:
            kids = self.ps.children(recursive=True)
        except psutil.Error:
            kids = []
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        _, alive = psutil.wait_procs(kids, timeout=15)
        for k in alive:
            try:
                k.kill()
            except psutil.Error:
                pass


def start_pdserve(cfg: str, model: str, logdir: Path) -> Server:
    ready = logdir / f"pdserve-{cfg}-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", "router.cli", "serve", model, *PDSERVE_CONFIGS[cfg], "--http-port", "0",
           "--zmq-port", "0", "--ready-file", str(ready), "--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED), "--num-kv-blocks", "2048"]
    s = Server(f"pdserve-{cfg}", cmd, dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO)),
               logdir / f"pdserve-{cfg}.log")
    s.cmd = " ".join(cmd[1:])  # type: ignore[attr-defined]
    while not ready.exists():
        s.fail_if_dead(300)
        time.sleep(0.2)
    info = json.loads(ready.read_text())
    s.url, s.worker_pids = info["http"], [w["pid"] for w in info["workers"].values()]
    log(f"{s.name}: ready at {s.url} after {time.monotonic() - s.t0:.1f} s (worker pids {s.worker_pids})")
    return s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_vllm(vllm_python: str, model: str, logdir: Path, *, max_model_len: int = MAX_MODEL_LEN,
               max_batched: int = MAX_BATCHED, name: str = "vllm") -> Server:
    """vLLM's OpenAI server on a free loopback port, both cores; returns once /v1/models answers."""
    port = free_port()
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", "float32",
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-num-batched-tokens", str(max_batched), "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    s = Server(name, cmd, vllm_env(vllm_python), logdir / "vllm.log")
    s.cmd = " ".join(cmd[1:])  # type: ignore[attr-defined]
    while True:
        s.fail_if_dead(900)  # the first start compiles (~100 s on 2 cores)
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        time.sleep(1.0)
    s.url = f"http://127.0.0.1:{port}/v1"
    log(f"{name}: ready at {s.url} after {time.monotonic() - s.t0:.1f} s")
    return s


# ---- offline ------------------------------------------------------------------------------

def offline(args: argparse.Namespace, model: str, vocab: int, tmp: Path) -> dict:
    from offline_throughput import kv_blocks_for, make_workload

    work = make_workload(args.offline_prompts, vocab, 0)
    wl = tmp / "offline_workload.json"
    wl.write_text(json.dumps({"model": model, "prompts": work.prompts, "output_lens": work.output_lens,
                              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                              "max_num_batched_tokens": MAX_BATCHED}))
    runs: dict[str, list[dict]] = {"pdserve": [], "vllm": []}
    for rep in range(args.offline_repeats):
        order = ["pdserve", "vllm"] if rep % 2 == 0 else ["vllm", "pdserve"]
        for eng in order:
            out = tmp / f"offline_{eng}_{rep}.json"
            if eng == "pdserve":
                cmd = [sys.executable, str(REPO / "benchmarks" / "offline_throughput.py"), "--child", "ours",
                       "--child-out", str(out), "--model", model, "--num-prompts", str(args.offline_prompts),
                       "--seed", "0", "--overhead-steps", "0"]
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
                         "pdserve_num_kv_blocks": kv_blocks_for(work), "pdserve_threads": 2},
            "runs": runs, "pdserve": p, "vllm": v,
            "ratio_pdserve_over_vllm": p["tokens_per_s"] / v["tokens_per_s"] if p and v else None}


# ---- serving ------------------------------------------------------------------------------

def measure(server: Server, others: list[Server], reqs, times) -> dict:
    load0 = os.getloadavg()[0]
    cpu0 = {s.name: tree_cpu_s(s.ps) for s in [server, *others]}
    coro = run_workload(reqs, "http", server.url, times, None, 0.0, True, False, 0, False)
    try:
        records, duration = asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))
    except asyncio.TimeoutError:
        return {"error": f"timed out after {POINT_TIMEOUT_S:.0f} s"}
    res = summarize(records, duration, SLO_TTFT_S, SLO_TPOT_S, (90, 99))
    cpu1 = {s.name: tree_cpu_s(s.ps) for s in [server, *others]}
    res.update(server_cpu_s=cpu1[server.name] - cpu0[server.name],
               idle_others_cpu_s={s.name: round(cpu1[s.name] - cpu0[s.name], 2) for s in others},
               loadavg_1m_before=load0, loadavg_1m_after=os.getloadavg()[0],
               errors=sorted({r.error for r in records if not r.success})[:3])
    return res


def serving(args: argparse.Namespace, model: str, vocab: int, logdir: Path, on_ready=None) -> dict:
    servers: list[Server] = []
    try:
        for cfg in args.configs.split(","):
            servers.append(start_pdserve(cfg, model, logdir))
        if args.vllm_python:
            servers.append(start_vllm(args.vllm_python, model, logdir))
        warm = random_workload(2, args.input_len, args.output_len, 0.0, vocab, seed=99)
        for s in servers:  # warm-up, not counted
            run = run_workload(warm, "http", s.url, [0.0, 0.0], None, 0.0, True, False, 0, False)
            recs, _ = asyncio.run(run)
            if not all(r.success for r in recs):
                raise RuntimeError(f"{s.name}: warm-up failed: {[r.error for r in recs]}")
        if on_ready:
            on_ready(servers)
        rates = [float(r) for r in args.rates.split(",")]
        points: dict[str, list[dict]] = {s.name: [] for s in servers}
        for i, rate in enumerate(rates):
            reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=100 + i)
            times = arrival_times(args.num_prompts, rate, 1.0, seed=i)
            order = servers if i % 2 == 0 else list(reversed(servers))
            for s in order:
                log(f"rate {rate} req/s: {s.name}")
                res = measure(s, [o for o in servers if o is not s], reqs, times)
                res["request_rate"] = rate
                points[s.name].append(res)
                if "error" in res:
                    log(f"  {s.name}: {res['error']}")
                    continue
                log(f"  {s.name:<18} done {res['completed']}/{args.num_prompts}  attain {res['slo_attainment']:4.0%}  "
                    f"TTFT mean {res['mean_ttft_ms']:7.0f} p99 {res['p99_ttft_ms']:7.0f} ms  TPOT mean "
                    f"{res['mean_tpot_ms']:6.1f} p99 {res['p99_tpot_ms']:6.1f} ms  goodput {res['request_goodput']:.2f} "
                    f"req/s  out {res['output_throughput']:.1f} tok/s  idle others cpu {res['idle_others_cpu_s']}")
        crosscheck = {}
        if args.crosscheck_rate and args.vllm_python:
            i = len(rates)
            for s in (servers if i % 2 == 0 else list(reversed(servers))):
                log(f"crosscheck at {args.crosscheck_rate} req/s: {s.name}, pdserve bench then vllm bench serve")
                reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=100 + i)
                times = arrival_times(args.num_prompts, args.crosscheck_rate, 1.0, seed=i)
                ours = measure(s, [o for o in servers if o is not s], reqs, times)
                theirs = vllm_bench_serve(args, s, model, logdir, seed=i)
                crosscheck[s.name] = {"pdserve_bench": ours, "vllm_bench_serve": theirs}
                if "error" not in ours and "error" not in theirs:
                    log(f"  {s.name:<18} TTFT mean {ours['mean_ttft_ms']:.0f} vs {theirs['mean_ttft_ms']:.0f} ms, "
                        f"TPOT mean {ours['mean_tpot_ms']:.1f} vs {theirs['mean_tpot_ms']:.1f} ms "
                        f"(pdserve bench vs vllm bench serve)")
        out = {"_crosscheck": crosscheck} if crosscheck else {}
        for s in servers:
            pts = points[s.name]
            ok = [p for p in pts if "error" not in p]
            out[s.name] = {"command": s.cmd, "sweep": pts,  # type: ignore[attr-defined]
                           "goodput_rate": goodput_rate([p["request_rate"] for p in ok],
                                                        [p["slo_attainment"] for p in ok])}
        return out
    finally:
        for s in servers:
            s.stop()


# `vllm bench serve` without the `vllm` console script (it needs dist metadata the
# `vllm-cpu` distribution does not provide): the subcommand's own parser and main
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())")


def vllm_bench_serve(args: argparse.Namespace, server: Server, model: str, logdir: Path, seed: int) -> dict:
    """One point of vLLM's own load generator (`vllm bench serve`, random dataset, the
    same lengths, rate and count as ours, Poisson) against `server`'s /v1/completions."""
    base = server.url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        model_id = json.loads(r.read())["data"][0]["id"]
    result = logdir / f"vllm_bench_{server.name}.json"
    cmd = [args.vllm_python, "-c", VLLM_BENCH_SERVE, "--backend", "openai",
           "--base-url", base, "--endpoint", "/v1/completions", "--model", model_id, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.crosscheck_rate), "--ignore-eos",
           "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "90,99", "--save-result", "--result-dir", str(logdir),
           "--result-filename", result.name]
    with open(logdir / f"vllm_bench_{server.name}.log", "wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(args.vllm_python),
                              timeout=POINT_TIMEOUT_S + 300)
    if done.returncode != 0 or not result.exists():
        return {"error": f"vllm bench serve exit {done.returncode}; see logs/vllm_bench_{server.name}.log"}
    res = json.loads(result.read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "total_input_tokens",
            "total_output_tokens")
    return {k: res[k] for k in keep if k in res} | {"command": " ".join(cmd[1:])}


# ---- report -------------------------------------------------------------------------------

def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in report.get("serving", {}).items():
        if name == "_crosscheck":
            continue
        pts = sorted((p for p in r["sweep"] if "error" not in p), key=lambda p: p["request_rate"])
        x = [p["request_rate"] for p in pts]
        line = axes[0].plot(x, [p["slo_attainment"] * 100 for p in pts], marker="o", label=name)[0]
        c = line.get_color()
        axes[1].plot(x, [p["mean_ttft_ms"] for p in pts], marker="o", color=c, label=f"{name} mean")
        axes[1].plot(x, [p["p99_ttft_ms"] for p in pts], marker="^", linestyle="--", color=c, label=f"{name} p99")
        axes[2].plot(x, [p["mean_tpot_ms"] for p in pts], marker="o", color=c, label=f"{name} mean")
        axes[2].plot(x, [p["p99_tpot_ms"] for p in pts], marker="^", linestyle="--", color=c, label=f"{name} p99")
    axes[0].axhline(90, color="gray", linestyle=":", linewidth=1)
    axes[0].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-5, 105),
                title="SLO attainment (TTFT <= 1 s, TPOT <= 100 ms)")
    axes[1].axhline(SLO_TTFT_S * 1000, color="gray", linestyle=":", linewidth=1)
    axes[1].set(xlabel="request rate (req/s)", ylabel="TTFT (ms)", yscale="log", title="TTFT")
    axes[2].axhline(SLO_TPOT_S * 1000, color="gray", linestyle=":", linewidth=1)
    axes[2].set(xlabel="request rate (req/s)", ylabel="TPOT (ms)", title="TPOT")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    off = report.get("offline") or {}
    parts = [f"{e} {off[e]['tokens_per_s']:.1f} tok/s" for e in ("pdserve", "vllm") if off.get(e)]
    fig.suptitle(f"pdserve vs vLLM (CPU, 2 cores, small qwen3 fp32); offline: {', '.join(parts) or 'not run'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (e.g. /work/vllm-venv/bin/python)")
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    p.add_argument("--out-dir", default=str(REPO / "results/vs_vllm"))
    p.add_argument("--configs", default="colocated,1p1d", help=f"pdserve configs, of {','.join(PDSERVE_CONFIGS)}")
    p.add_argument("--rates", default="1,3")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--offline-repeats", type=int, default=1)
    p.add_argument("--crosscheck-rate", type=float, default=None,
                   help="after the sweep, one more point at this rate per server with our client and then "
                        "with `vllm bench serve` (needs --vllm-python), to check the two clients agree")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-serving", action="store_true")
    p.add_argument("--py-spy-pid-file", default=None,
                   help="write the first pdserve server's worker pids here once all servers are warm (for profiling)")
    args = p.parse_args()
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
        from common.model_factory import make_model
        log(f"making the small qwen3 model in {args.model}")
        make_model(args.model, "qwen3", "small", seed=0)
    vocab = ModelConfig.from_dir(args.model).vocab_size
    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "command": " ".join([Path(sys.executable).name, *sys.argv]),
                    "pdserve_commit": git.stdout.strip(), "vllm_version": vver, "vllm_env": VLLM_ENV | {"LD_PRELOAD": "libiomp5.so"},
                    "model": args.model, "slo": {"ttft_ms": SLO_TTFT_S * 1000, "tpot_ms": SLO_TPOT_S * 1000},
                    "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_at_start": os.getloadavg()}}
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
    report["host"]["loadavg_at_end"] = os.getloadavg()
    report["runtime_s"] = time.monotonic() - t0
    (out_dir / "results.json").write_text(json.dumps(report, indent=2))
    plot(report, out_dir / "vs_vllm.png")
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
            print(f"{name:<18} rate {pt['request_rate']}: TTFT mean/p99 {pt['mean_ttft_ms']:.0f}/{pt['p99_ttft_ms']:.0f} ms, "
                  f"TPOT mean/p99 {pt['mean_tpot_ms']:.1f}/{pt['p99_tpot_ms']:.1f} ms, attainment "
                  f"{pt['slo_attainment']:.0%}, goodput {pt['request_goodput']:.2f} req/s")
        print(f"{name:<18} goodput rate: {r['goodput_rate']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
