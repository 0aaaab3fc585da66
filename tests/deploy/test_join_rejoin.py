"""A joined worker (`pdserve worker --join`) has no router pid to watch: when its router
dies it keeps running, and a router started again at the same address has it registered
at once (its hello on the new connection) and serving, without restarting the worker."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from pdserve.router.launch.local import free_port
from tests.support.serving import _wait_ok


def _complete(url: str, model: str) -> list[int]:
    body = json.dumps({"model": model, "prompt": "Hello there", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)["choices"][0]["token_ids"]


def test_joined_worker_outlives_its_router_and_rejoins_a_new_one(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    http, zmq_port, control = free_port(), free_port(), free_port()
    url = f"http://127.0.0.1:{http}"
    cli = [sys.executable, "-m", "pdserve"]
    env = dict(os.environ, PYTHONPATH=os.getcwd())

    def start(argv: list[str], log: str) -> subprocess.Popen:
        with open(tmp_path / log, "ab") as f:
            return subprocess.Popen([*cli, *argv, model, "--secret-file", str(secret)], stdout=f,
                                    stderr=subprocess.STDOUT, env=env)

    router_argv = ["router", "--http-port", str(http), "--zmq-port", str(zmq_port), "--control-port", str(control)]
    procs = [start(router_argv, "router.log"),
             start(["worker", "--role", "colocated", "--join", f"tcp://127.0.0.1:{control}", "--router-timeout", "1",
                    "--worker-id", "c0", "--num-kv-blocks", "512", "--num-threads", "1"], "worker.log")]
    try:
        _wait_ok(url, procs, 120)
        first = _complete(url, Path(model).name)
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait()
        time.sleep(3)  # three of its router-timeouts: a pid-watching worker would be gone by now
        assert procs[1].poll() is None, (tmp_path / "worker.log").read_text()
        procs[0] = start(router_argv, "router.log")
        _wait_ok(url, procs, 120)  # the router starts (slow on a loaded machine), then a hello registers the worker
        assert _complete(url, Path(model).name) == first
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
