"""Three hosts on one machine: the router, a prefill worker and a decode worker each in
its own network namespace, joined by a bridge (in a fourth namespace, away from the
machine's firewall rules), started with `pdserve router` and `pdserve worker --join`. Real
bytes cross the veths: greedy output over HTTP equals the offline engine's at float32
(which tests/common proves equal to transformers'), and the P/D pair uses tcp, never shm.

Needs root (CI runs as root): without the privilege it FAILS, saying so."""
from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common import LLM, SamplingParams

PROMPTS = ["Hello there", "The router sends the request to a prefill worker"]
MAX_TOKENS = 8
HTTP, ZMQ, CONTROL, WORKER = 8000, 8001, 8002, 8100  # each namespace has its own ports

CLIENT = r"""
import json, sys, time, urllib.request, urllib.error
base, prompts, max_tokens, model = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 180
while True:  # the workers load the model, then join: the router says ok once both are live
    try:
        with urllib.request.urlopen(base + "/health", timeout=5) as r:
            if json.load(r)["status"] == "ok":
                break
    except (urllib.error.URLError, OSError):
        pass
    if time.monotonic() > deadline:
        sys.exit("the router never had a live prefill and decode worker")
    time.sleep(0.5)
outs = []
for p in prompts:
    body = json.dumps({"model": model, "prompt": p, "max_tokens": max_tokens, "temperature": 0}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        outs.append(json.load(r)["choices"][0]["token_ids"])
time.sleep(1.5)  # one more heartbeat: the prefill worker's byte counter reaches /metrics
with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
    metrics = r.read().decode()
print(json.dumps({"token_ids": outs, "metrics": metrics}))
"""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


class Hosts:
    """Owns the namespaces, veths and bridge of one test run (names unique per run);
    `close` removes them all, and every process started in them."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000:05d}{secrets.token_hex(1)}"
        self.prefix = f"pd{tag}"  # <= 9 chars: interface names stay within 15
        n = int(tag[:5])
        self.subnet = f"10.{200 + n % 50}.{(n // 50) % 250}"
        self.hub = f"{self.prefix}hub"
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []

    def open(self, names: list[str]) -> dict[str, str]:
        """One namespace per name, each with an address on the shared /24; returns name -> address."""
        if os.geteuid() != 0:
            pytest.fail("this test needs root to create network namespaces (ip netns add); it runs as root in CI")
        add = sh("ip", "netns", "add", self.hub, check=False)
        if add.returncode != 0:
            pytest.fail(f"cannot create a network namespace (ip netns add: {add.stderr.strip()}): this test needs "
                        f"the privilege (root, CAP_SYS_ADMIN, CAP_NET_ADMIN)")
        self.created.append(self.hub)
        hub = ("ip", "netns", "exec", self.hub)
        sh(*hub, "ip", "link", "add", "br0", "type", "bridge")
        sh(*hub, "ip", "link", "set", "br0", "up")
        addresses = {}
        for i, name in enumerate(names, start=1):
            ns, veth = f"{self.prefix}{name}", f"{self.prefix}{name[0]}"
            sh("ip", "netns", "add", ns)
            self.created.append(ns)
            sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "h")
            sh("ip", "link", "set", veth + "h", "netns", self.hub)
            sh(*hub, "ip", "link", "set", veth + "h", "master", "br0", "up")
            sh("ip", "link", "set", veth, "netns", ns)
            inside = ("ip", "netns", "exec", ns)
            addresses[name] = f"{self.subnet}.{i}"
            sh(*inside, "ip", "addr", "add", f"{addresses[name]}/24", "dev", veth)
            sh(*inside, "ip", "link", "set", veth, "up")
            sh(*inside, "ip", "link", "set", "lo", "up")
        return addresses

    def run(self, name: str, argv: list[str], log: Path) -> subprocess.Popen:
        with open(log, "wb") as f:
            proc = subprocess.Popen(["ip", "netns", "exec", f"{self.prefix}{name}", *argv], stdout=f,
                                    stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        for ns in reversed(self.created):  # anything still inside (a worker's child) goes with it
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)


def test_router_and_workers_in_three_namespaces(model_dirs, tmp_path):
    model = model_dirs["qwen3"]
    secret = tmp_path / "secret"
    secret.write_text(secrets.token_hex(32))
    secret.chmod(0o600)
    cli = [sys.executable, "-m", "router.cli"]
    common = ["--secret-file", str(secret), "--dtype", "float32"]
    hosts = Hosts()
    try:
        addr = hosts.open(["router", "prefill", "decode"])
        join = f"tcp://{addr['router']}:{CONTROL}"
        procs = {"router": hosts.run("router", [*cli, "router", model, "--host", addr["router"], "--http-port",
                                                str(HTTP), "--zmq-port", str(ZMQ), "--control-port", str(CONTROL),
                                                *common], tmp_path / "router.log")}
        for role in ("prefill", "decode"):
            procs[role] = hosts.run(role, [*cli, "worker", model, "--role", role, "--join", join, "--host", addr[role],
                                           "--port", str(WORKER), "--worker-id", role, *common], tmp_path / f"{role}.log")
        client = subprocess.run(["ip", "netns", "exec", f"{hosts.prefix}router", sys.executable, "-c", CLIENT,
                                 f"http://{addr['router']}:{HTTP}", json.dumps(PROMPTS),
                                 str(MAX_TOKENS), Path(model).name], capture_output=True, text=True, timeout=300)
        logs = {name: (tmp_path / f"{name}.log").read_text(errors="replace") for name in procs}
        assert client.returncode == 0, f"client: {client.stderr}\n" + "\n".join(f"--- {n}\n{t[-3000:]}"
                                                                                  for n, t in logs.items())
        got = json.loads(client.stdout)
        llm = LLM(model, dtype="float32")
        want = [o["token_ids"] for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]
        assert got["token_ids"] == want
        # the pair is on two hosts: tcp, and its KV bytes really went over it
        for role in ("prefill", "decode"):
            assert "kv transfer tcp" in logs[role] and "shm" not in logs[role], logs[role]
        sent = [line for line in got["metrics"].splitlines()
                if line.startswith("pdserve_worker_kv_transfer_bytes{") and 'worker_id="prefill"' in line]
        assert sent and float(sent[0].rsplit(" ", 1)[1]) > 0, got["metrics"][-2000:]
        for name, proc in procs.items():
            assert proc.poll() is None, f"{name} exited:\n{logs[name][-3000:]}"
    finally:
        hosts.close()
    leftover = sh("ip", "netns", "list").stdout
    assert hosts.prefix not in leftover
