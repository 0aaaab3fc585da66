"""The servers the benchmarks compare, as processes: pdserve (`pdserve serve`, one of
`PDSERVE_CONFIGS`) and vLLM's CPU build (its OpenAI server, in its own venv, with the
environment that pins its threads to the 2 cores and sizes its KV cache), plus vLLM's own load
generator, `vllm bench serve`. How vLLM is installed and run: docs/benchmarks.md."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import psutil

from benchmarks.harness.paths import REPO

MAX_MODEL_LEN, MAX_NUM_SEQS, MAX_BATCHED = 1024, 64, 2048
PDSERVE_CONFIGS = {
    "colocated": ["--prefill", "0", "--decode", "0", "--colocated", "1", "--num-threads", "2"],
    "1p1d": ["--prefill", "1", "--decode", "1", "--num-threads", "1"],
    "2p1d": ["--prefill", "2", "--decode", "1", "--num-threads", "1"],
}
VLLM_ENV = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
            "VLLM_CPU_KVCACHE_SPACE": "4", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
# --emulate-avx2: an AVX-512 machine run as the AVX2 machines this project targets. torch's
# ATen kernels, oneDNN and MKL are capped at AVX2, pdserve's C kernels are built without
# AVX-512 (a build of their own, keyed by the flags), and vLLM loads its AVX2 kernels
# (benchmarks/harness/avx2_hook/sitecustomize.py). The CPU is still the same, caches and all.
AVX2_ENV = {"PDSERVE_EMULATE_AVX2": "1", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
            "DNNL_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "PDSERVE_KERNEL_CFLAGS": "-mno-avx512f"}
AVX2_HOOK = Path(__file__).resolve().parent / "avx2_hook"


def emulate_avx2() -> dict[str, str]:
    """Set AVX2_ENV in this process, for every server and child started after; returns it."""
    os.environ.update(AVX2_ENV)
    return AVX2_ENV


def repo_pythonpath(repo: Path = REPO) -> str:
    """PYTHONPATH with the repository first, keeping what was there (wheels installed aside)."""
    return os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def vllm_env(vllm_python: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(VLLM_ENV)
    if env.get("PDSERVE_EMULATE_AVX2") == "1":
        env["PYTHONPATH"] = str(AVX2_HOOK)
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


def cpu_by_pid(proc: psutil.Process) -> dict[int, float]:
    """CPU seconds of a process and of each live descendant, by pid."""
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return {}
    out = {}
    for p in procs:
        try:
            t = p.cpu_times()
            out[p.pid] = t.user + t.system
        except psutil.Error:
            pass
    return out


def cpu_split(root: int, before: dict[int, float], after: dict[int, float]) -> dict:
    """CPU seconds spent between two `cpu_by_pid` samples: the root process's (a pdserve
    server's router) and its descendants' (the workers: those alive at the end; one that
    started in between counts from 0, one that exited in between is lost and counted)."""
    kids = {pid: t - before.get(pid, 0.0) for pid, t in after.items() if pid != root}
    return {"root_s": round(after.get(root, 0.0) - before.get(root, 0.0), 3),
            "descendants_s": round(sum(kids.values()), 3),
            "exited": sum(1 for pid in before if pid not in after)}


# ---- servers ------------------------------------------------------------------------------

def exit_on_sigterm() -> None:
    """SIGTERM to the benchmark ends it through its `finally` blocks, which stop its servers:
    they run in sessions of their own, so neither SIGTERM nor Ctrl-C reaches them."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log_path: Path):
        exit_on_sigterm()
        self.name, self.log_path = name, log_path
        self.t0 = time.monotonic()
        with open(log_path, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.ps = psutil.Process(self.proc.pid)
        self.url = ""
        self.worker_pids: list[int] = []
        self.info: dict = {}  # pdserve's ready file: addresses, secret file, workers

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


def start_pdserve(cfg: str, model: str, logdir: Path, extra: list[str] = (), *, repo: Path = REPO,
                  name: str = "", dtype: str = "float32", module: str = "pdserve") -> Server:
    """`pdserve serve` in one of PDSERVE_CONFIGS, plus `extra` flags (devices, say), from the
    checkout `repo` (another commit's worktree: an A/B of two commits in one run; `module`:
    its command's module, `router.cli` before the code moved under pdserve/)."""
    ready = logdir / f"pdserve-{cfg}-{time.time_ns()}.json"
    cmd = [sys.executable, "-m", module, "serve", model, *PDSERVE_CONFIGS[cfg], "--http-port", "0",
           "--zmq-port", "0", "--ready-file", str(ready), "--dtype", dtype, "--max-model-len", str(MAX_MODEL_LEN),
           "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(MAX_BATCHED), "--num-kv-blocks", "2048",
           *extra]
    name = name or f"pdserve-{cfg}"
    s = Server(name, cmd, dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=repo_pythonpath(repo)),
               logdir / f"{name}.log")
    s.cmd = " ".join(cmd[1:])  # type: ignore[attr-defined]
    while not ready.exists():
        s.fail_if_dead(300)
        time.sleep(0.2)
    s.info = json.loads(ready.read_text())
    s.url, s.worker_pids = s.info["http"], [w["pid"] for w in s.info["workers"].values()]
    log(f"{s.name}: ready at {s.url} after {time.monotonic() - s.t0:.1f} s (worker pids {s.worker_pids})")
    return s


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_vllm(vllm_python: str, model: str, logdir: Path, *, max_model_len: int = MAX_MODEL_LEN,
               max_batched: int = MAX_BATCHED, name: str = "vllm", dtype: str = "float32") -> Server:
    """vLLM's OpenAI server on a free loopback port, both cores; returns once /v1/models answers."""
    port = free_port()
    cmd = [vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--dtype", dtype,
           "--max-model-len", str(max_model_len), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-num-batched-tokens", str(max_batched), "--host", "127.0.0.1", "--port", str(port), "--seed", "0"]
    s = Server(name, cmd, vllm_env(vllm_python), logdir / f"{name}.log")
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


# `vllm bench serve` without the `vllm` console script (it needs dist metadata the
# `vllm-cpu` distribution does not provide): the subcommand's own parser and main
VLLM_BENCH_SERVE = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
                    "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
                    "p = FlexibleArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())")


def vllm_bench_serve(vllm_python: str, server: Server, model: str, logdir: Path, *, input_len: int,
                     output_len: int, num_prompts: int, rate: float, seed: int, timeout_s: float) -> dict:
    """One point of vLLM's own load generator (`vllm bench serve`, random dataset,
    Poisson arrivals) against `server`'s /v1/completions: its summary figures."""
    base = server.url.removesuffix("/").removesuffix("/v1")
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        model_id = json.loads(r.read())["data"][0]["id"]
    result = logdir / f"vllm_bench_{server.name}.json"
    cmd = [vllm_python, "-c", VLLM_BENCH_SERVE, "--backend", "openai",
           "--base-url", base, "--endpoint", "/v1/completions", "--model", model_id, "--tokenizer", model,
           "--dataset-name", "random", "--random-input-len", str(input_len),
           "--random-output-len", str(output_len), "--random-range-ratio", "0",
           "--num-prompts", str(num_prompts), "--request-rate", str(rate), "--ignore-eos",
           "--seed", str(seed), "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el",
           "--metric-percentiles", "90,99", "--save-result", "--result-dir", str(logdir),
           "--result-filename", result.name]
    with open(logdir / f"vllm_bench_{server.name}.log", "wb") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=vllm_env(vllm_python),
                              timeout=timeout_s)
    if done.returncode != 0 or not result.exists():
        return {"error": f"vllm bench serve exit {done.returncode}; see logs/vllm_bench_{server.name}.log"}
    res = json.loads(result.read_text())
    keep = ("completed", "failed", "duration", "request_throughput", "output_throughput", "mean_ttft_ms",
            "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "mean_itl_ms", "mean_e2el_ms", "total_input_tokens",
            "total_output_tokens")
    return {k: res[k] for k in keep if k in res} | {"command": " ".join(cmd[1:])}
