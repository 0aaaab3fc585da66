"""Elastic pools of a router running alone (`pdserve router`): it starts no workers, so
`pdserve scale --prefill +1` is refused with how to join one; a worker that joins takes
traffic; `pdserve scale --worker p0 --drain` drains a prefill worker under a steady
stream (its hand-offs finish, no request fails) and the `pdserve worker` process exits
with code 0."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pdserve.router.launch.local import free_port
from tests.support.serving import _health, _wait_ok

MAX_NEW = 8


def _complete(url: str, model: str, prompt: str) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return {"token_ids": json.load(r)["choices"][0]["token_ids"], "error": None}
    except Exception as e:
        return {"token_ids": [], "error": f"{type(e).__name__}: {e}"}


def test_router_alone_drains_a_joined_prefill_worker_which_exits_0(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    name = Path(model).name
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    http, control = free_port(), free_port()
    url, join = f"http://127.0.0.1:{http}", f"tcp://127.0.0.1:{control}"
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    cli = [sys.executable, "-m", "pdserve"]

    def start(argv: list[str], log: str) -> subprocess.Popen:
        with open(tmp_path / log, "ab") as f:
            return subprocess.Popen([*cli, *argv, model, "--secret-file", str(secret), "--num-threads", "1"],
                                    stdout=f, stderr=subprocess.STDOUT, env=env)

    def worker(role: str, wid: str) -> subprocess.Popen:
        return start(["worker", "--role", role, "--join", join, "--worker-id", wid, "--heartbeat", "0.2",
                      "--num-kv-blocks", "512"], wid + ".log")  # not 20% of the host's RAM

    def scale(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([*cli, "scale", "--router", join, "--secret-file", str(secret), "--json", *flags],
                              capture_output=True, text=True, env=env, timeout=120)

    router = start(["router", "--http-port", str(http), "--zmq-port", str(free_port()), "--control-port",
                    str(control)], "router.log")
    procs = {"router": router, "p0": worker("prefill", "p0"), "d0": worker("decode", "d0")}
    try:
        _wait_ok(url, list(procs.values()), 120)
        refused = scale("--prefill", "+1")
        assert refused.returncode == 1 and "accepts whoever joins" in refused.stderr and \
            f"pdserve worker --role prefill --join {join}" in refused.stderr, refused.stderr
        first = _complete(url, name, "Hello there")
        assert first["error"] is None
        procs["p1"] = worker("prefill", "p1")  # scale up: it joins
        while "p1" not in (_health(url) or {}).get("pools", {}):
            assert procs["p1"].poll() is None, (tmp_path / "p1.log").read_text()
            time.sleep(0.2)
        results: list[dict] = []
        halt = threading.Event()

        def stream() -> None:
            while not halt.is_set():
                results.append(_complete(url, name, "Hello there"))
        client = threading.Thread(target=stream)
        client.start()
        try:
            time.sleep(0.5)
            drained = scale("--worker", "p0", "--drain", "--wait", "60")
            assert drained.returncode == 0, drained.stderr + (tmp_path / "router.log").read_text()
            assert procs["p0"].wait(30) == 0, (tmp_path / "p0.log").read_text()  # exits clean
            time.sleep(0.5)
        finally:
            halt.set()
            client.join(120)
        assert results and all(r["error"] is None and r["token_ids"] == first["token_ids"] for r in results), results
        pools = _health(url)["pools"]
        assert "p0" not in pools and pools["p1"]["state"] == "serving" and pools["p1"]["routed"] > 0, pools
        assert procs["p1"].poll() is None and procs["d0"].poll() is None
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
