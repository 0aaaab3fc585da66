"""How soon a new worker takes traffic (target: within 5 s of being ready). A `pdserve
serve --prefill 1 --decode 1` of the tiny model serves a steady stream of requests;
`pdserve scale`'s request (router/pools/client.py) adds one worker of each `--roles`,
one at a time. For each new worker, from the router's /health (polled every 20 ms):

- spawn_to_registered_s: from the scale request's answer to the worker's hello (process
  start, imports, model load: the cost of a cold worker, not of the router);
- registered_to_first_request_s: from its hello to the first request routed to it (what
  the router adds; the 5 s target).

    python -m benchmarks.serving.join_time [--roles prefill,decode] [--model DIR] [--out results/join_time.json]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.harness.paths import REPO

from pdserve.router.pools.client import ControlClient

POLL_S = 0.02


def start(model: str, workdir: Path) -> tuple[subprocess.Popen, dict]:
    """`pdserve serve --prefill 1 --decode 1` at its default routing, once ready."""
    ready = workdir / "ready.json"
    cmd = [sys.executable, "-m", "pdserve", "serve", model, "--prefill", "1", "--decode", "1", "--http-port", "0",
           "--zmq-port", "0", "--num-kv-blocks", "512", "--max-model-len", "512", "--num-threads", "1",
           "--ready-file", str(ready)]
    proc = subprocess.Popen(cmd, stdout=open(workdir / "serve.log", "wb"), stderr=subprocess.STDOUT, cwd=REPO)
    while not ready.exists():
        if proc.poll() is not None:
            raise SystemExit(f"serve exited:\n{(workdir / 'serve.log').read_text()[-3000:]}")
        time.sleep(0.1)
    return proc, json.loads(ready.read_text())


def health(base: str) -> dict:
    with urllib.request.urlopen(base + "/health", timeout=10) as r:
        return json.load(r)


def stream(http: str, halt: threading.Event, done: list[float]) -> None:
    while not halt.is_set():  # a new prompt each time (no worker holds its prefix), as a stream of users sends
        body = json.dumps({"prompt": f"User {len(done)} asks: where does the router send each request?",
                           "max_tokens": 8, "temperature": 0}).encode()
        req = urllib.request.Request(http + "/completions", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            r.read()
        done.append(time.monotonic())


def join_one(client: ControlClient, base: str, role: str) -> dict:
    reply = client.scale(role, 1)
    asked = time.monotonic()
    (wid,) = reply.worker_ids
    registered = None
    while True:
        w = health(base)["pools"].get(wid)
        now = time.monotonic()
        if w is not None and registered is None:
            registered = now
        if w is not None and w["routed"] > 0:
            return {"role": role, "worker_id": wid, "spawn_to_registered_s": round(registered - asked, 3),
                    "registered_to_first_request_s": round(now - registered, 3)}
        if now - asked > 300:
            raise SystemExit(f"{wid} took no request within 300 s: {health(base)}")
        time.sleep(POLL_S)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--roles", default="prefill,decode")
    p.add_argument("--model", default=str(Path(tempfile.gettempdir()) / "pdserve-join-tiny"))
    p.add_argument("--out", default="", help="also write the JSON here")
    args = p.parse_args()
    if not Path(args.model, "config.json").exists():
        from pdserve.common.loading.model_factory import make_model
        make_model(args.model, "qwen3", "tiny", seed=0)
    with tempfile.TemporaryDirectory() as tmp:
        proc, info = start(args.model, Path(tmp))
        base = info["http"].removesuffix("/v1")
        halt, done = threading.Event(), []
        client_thread = threading.Thread(target=stream, args=(info["http"], halt, done))
        client = ControlClient(info["control"], Path(info["secret_file"]).read_text().strip(), curve=info.get("curve", False))
        try:
            client_thread.start()
            rows = [join_one(client, base, role) for role in args.roles.split(",")]
        finally:
            halt.set()
            client_thread.join(60)
            client.close()
            proc.terminate()
            proc.wait(30)
    result = {"joins": rows, "requests_served": len(done),
              "max_registered_to_first_request_s": max(r["registered_to_first_request_s"] for r in rows),
              "target_s": 5.0}
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
