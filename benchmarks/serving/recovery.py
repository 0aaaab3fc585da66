"""Recovery cost: requests lost (target 0) and latency added when a worker is killed
(kill -9) under steady load. Runs the same workload twice side by side on fresh
deployments of the tiny model -- once undisturbed, once with a prefill or a decode worker
killed a few seconds in -- and prints TTFT / E2E of both and their ratio.

    python -m benchmarks.serving.recovery [--kill prefill|decode] [--requests 48] [--concurrency 8]
"""
from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.harness.paths import REPO
FAST = ["--stale-after", "2", "--heartbeat", "0.2", "--peer-timeout", "2", "--router-timeout", "1", "--lease", "5"]


def start(model: str, workdir: Path, roles: list[str]) -> tuple[subprocess.Popen, dict]:
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "pdserve", "serve", model, *roles, "--http-port", "0", "--zmq-port", "0",
           "--num-kv-blocks", "512", "--max-model-len", "512", "--num-threads", "1", "--routing", "round_robin",
           "--ready-file", str(ready), *FAST]
    proc = subprocess.Popen(cmd, stdout=open(workdir / "serve.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit(f"serve exited:\n{(workdir / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def one(http: str, i: int, max_tokens: int) -> dict:
    body = json.dumps({"prompt": f"Request {i}: the router sends each request to", "stream": True,
                       "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}).encode()
    t0 = time.perf_counter()
    ttft, n, err = None, 0, None
    req = urllib.request.Request(http + "/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            for line in resp:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]["message"]
                got = sum(len(c.get("token_ids") or []) for c in chunk.get("choices", []))
                if got and ttft is None:
                    ttft = time.perf_counter() - t0
                n += got
    except Exception as e:  # noqa: BLE001 -- a lost request is what we count
        err = str(e)
    return {"ttft": ttft, "e2e": time.perf_counter() - t0, "tokens": n, "error": err or (None if n == max_tokens
                                                                                         else f"{n} tokens")}


def run(model: str, kill: str | None, args: argparse.Namespace) -> list[dict]:
    with tempfile.TemporaryDirectory() as d:
        proc, info = start(model, Path(d), ["--prefill", "2", "--decode", "2"])
        try:
            if kill:
                pid = info["workers"][f"{kill}-0"]["pid"]
                threading.Timer(args.kill_after, os.kill, (pid, signal.SIGKILL)).start()
            with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
                return list(pool.map(lambda i: one(info["http"], i, args.max_tokens), range(args.requests)))
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)


def summary(name: str, res: list[dict]) -> dict:
    ok = [r for r in res if r["error"] is None]
    return {"run": name, "requests": len(res), "lost": len(res) - len(ok),
            "ttft_mean_s": statistics.mean(r["ttft"] for r in ok), "ttft_max_s": max(r["ttft"] for r in ok),
            "e2e_mean_s": statistics.mean(r["e2e"] for r in ok), "e2e_max_s": max(r["e2e"] for r in ok)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--kill", choices=["prefill", "decode"], default="decode")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kill-after", type=float, default=3.0, help="seconds into the run")
    p.add_argument("--model", default=str(Path(tempfile.gettempdir()) / "pdserve-recovery-tiny"))
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from pdserve.common.loading.model_factory import make_model
        make_model(args.model, "qwen3", "tiny", seed=0)
    base = summary("undisturbed", run(args.model, None, args))
    hit = summary(f"{args.kill}-0 killed at {args.kill_after:g} s", run(args.model, args.kill, args))
    for s in (base, hit):
        print(json.dumps(s))
    print(json.dumps({"lost": hit["lost"], "ttft_mean_ratio": hit["ttft_mean_s"] / base["ttft_mean_s"],
                      "e2e_mean_ratio": hit["e2e_mean_s"] / base["e2e_mean_s"],
                      "e2e_max_added_s": hit["e2e_max_s"] - base["e2e_max_s"]}))


if __name__ == "__main__":
    main()
