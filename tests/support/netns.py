"""Hosts on one machine for the deploy tests: network namespaces joined by a bridge (in
a namespace of its own, away from the machine's firewall rules), a router and workers
started in them with `pdserve router` / `pdserve worker --join`, and a client run
inside one of them. Needs root; without the privilege a test FAILS, saying so."""
from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HTTP, ZMQ, CONTROL, WORKER = 8000, 8001, 8002, 8100  # each namespace has its own ports
CLI = [sys.executable, "-m", "pdserve"]
# every worker: a small KV cache (by default a worker takes 20% of the host's RAM for it,
# GBs per worker: slow to allocate, and two or three of them beside the suite run a CI box
# out of memory) and one torch thread (2 cores are shared by all the hosts)
WORKER_DEFAULTS = ("--num-kv-blocks", "512", "--num-threads", "1")

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


# The start of a client script run inside a namespace: `base` (the router's URL) is set by
# the script after it; get(path) -> body bytes (an error status's too), wait(test, what,
# timeout) -> whether `test()` came true in time (else it prints "timeout WHAT"), and
# free_blocks(names) -> worker id -> (free, total) blocks as /metrics shows them.
CLIENT_PRELUDE = r"""
import json, re, sys, time, urllib.request, urllib.error

def get(path):
    try:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return r.read()
    except urllib.error.HTTPError as e:
        return e.read()

def wait(test, what, timeout):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if test():
                return True
        except (urllib.error.URLError, OSError, ValueError):
            pass
        if time.monotonic() > deadline:
            print(f"timeout {what}", flush=True)
            return False
        time.sleep(0.3)

def free_blocks(names):
    text = get("/metrics").decode()
    gauges = {(m[1], m[2]): float(m[3]) for m in re.finditer(
        r'^pdserve_worker_(free|total)_blocks\{(?:role="\w+",)?worker_id="(\w+)"[^}]*\} ([\d.e+-]+)$', text, re.M)}
    return {w: (gauges.get(("free", w)), gauges.get(("total", w))) for w in names}
"""


def sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check)


def write_secret(path: Path) -> str:
    """A fresh deployment secret in a file only its owner reads; returns the path."""
    path.write_text(secrets.token_hex(32))
    path.chmod(0o600)
    return str(path)


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
        self.links: dict[str, str] = {}  # host name -> its veth (the bridge's end: + "h")
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
        sh(*self.inside("hub"), "ip", "link", "add", "br0", "type", "bridge")
        sh(*self.inside("hub"), "ip", "link", "set", "br0", "up")
        return {name: self._attach(name, i) for i, name in enumerate(names, start=1)}

    def _attach(self, name: str, i: int) -> str:
        """Namespace `name`, its veth to the bridge and its address (host number `i`)."""
        ns, veth = f"{self.prefix}{name}", f"{self.prefix}v{i}"
        sh("ip", "netns", "add", ns)
        self.created.append(ns)
        self.links[name] = veth
        sh("ip", "link", "add", veth, "type", "veth", "peer", "name", veth + "h")
        sh("ip", "link", "set", veth + "h", "netns", self.hub)
        sh(*self.inside("hub"), "ip", "link", "set", veth + "h", "master", "br0", "up")
        sh("ip", "link", "set", veth, "netns", ns)
        address = f"{self.subnet}.{i}"
        sh(*self.inside(name), "ip", "addr", "add", f"{address}/24", "dev", veth)
        sh(*self.inside(name), "ip", "link", "set", veth, "up")
        sh(*self.inside(name), "ip", "link", "set", "lo", "up")
        return address

    def inside(self, name: str) -> list[str]:
        """The argv prefix that runs a command in host `name`'s namespace."""
        return ["ip", "netns", "exec", f"{self.prefix}{name}"]

    def run(self, name: str, argv: list[str], log: Path, **popen) -> subprocess.Popen:
        """`argv` in host `name`, its output in `log` unless `popen` says otherwise."""
        with open(log, "wb") as f:
            popen = {"stdout": f, "stderr": subprocess.STDOUT, **popen}
            proc = subprocess.Popen([*self.inside(name), *argv], env=dict(os.environ, PYTHONPATH=os.getcwd()), **popen)
        self.procs.append(proc)
        return proc

    def kill(self, name: str) -> None:
        """Host `name` dies: its cable is pulled (the bridge's end of its veth goes down,
        so peers hear nothing more, not even a reset), then every process in it is SIGKILLed."""
        sh(*self.inside("hub"), "ip", "link", "set", self.links[name] + "h", "down")
        self._kill_all(f"{self.prefix}{name}")

    def reconnect(self, name: str) -> None:
        """Host `name`'s cable is plugged in again (after `kill`: a host that rebooted)."""
        sh(*self.inside("hub"), "ip", "link", "set", self.links[name] + "h", "up")

    def _kill_all(self, ns: str) -> None:
        for pid in sh("ip", "netns", "pids", ns, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass

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
            self._kill_all(ns)
            sh("ip", "netns", "del", ns, check=False)

    def leftover(self) -> bool:
        """Whether any namespace of this run still exists."""
        return self.prefix in sh("ip", "netns", "list").stdout


def start_router(hosts: Hosts, model: str, address: str, log: Path, common: list[str],
                 router_flags: tuple[str, ...] = ()) -> subprocess.Popen:
    """`pdserve router` in host "router", at `address` and the fixed ports."""
    return hosts.run("router", [*CLI, "router", model, "--host", address, "--http-port", str(HTTP), "--zmq-port",
                                str(ZMQ), "--control-port", str(CONTROL), *common, *router_flags], log)


def start_cluster(hosts: Hosts, model: str, addr: dict[str, str], workers: dict[str, str], logs: Path,
                  common: list[str], router_flags: tuple[str, ...] = (), worker_flags: tuple[str, ...] = (),
                  own_flags: dict[str, tuple[str, ...]] | None = None) -> dict[str, subprocess.Popen]:
    """`pdserve router` in host "router" and one `pdserve worker --join` per entry of
    `workers` (host name -> role; the host name is its worker id; its flags WORKER_DEFAULTS,
    `common`, `worker_flags`, then `own_flags`: flags of that worker alone), each logging to
    logs/<host>.log; returns host name -> process."""
    procs = {"router": start_router(hosts, model, addr["router"], logs / "router.log", common, router_flags)}
    for name, role in workers.items():
        procs[name] = start_worker(hosts, model, addr, name, role, logs, [*common, *worker_flags,
                                                                          *(own_flags or {}).get(name, ())])
    return procs


def start_worker(hosts: Hosts, model: str, addr: dict[str, str], name: str, role: str, logs: Path,
                 flags: list[str]) -> subprocess.Popen:
    """`pdserve worker --join` in host `name` (its worker id), joining the router in host
    "router", WORKER_DEFAULTS then `flags`, logging to logs/<name>.log."""
    join = f"tcp://{addr['router']}:{CONTROL}"
    return hosts.run(name, [*CLI, "worker", model, "--role", role, "--join", join, "--host", addr[name], "--port",
                            str(WORKER), "--worker-id", name, *WORKER_DEFAULTS, *flags], logs / f"{name}.log")


def wait_router_ready(log: Path, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    """Until the router's log has its ready banner ("Workers join:"); fails if it exits first."""
    deadline = time.monotonic() + timeout_s
    while "Workers join:" not in log.read_text(errors="replace"):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"the router was not ready (exit {proc.poll()}):\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


def read_logs(logs: Path, names) -> dict[str, str]:
    return {name: (logs / f"{name}.log").read_text(errors="replace") for name in names}


def tails(logs: dict[str, str]) -> str:
    """The end of every log, for an assertion message."""
    return "\n".join(f"--- {name}\n{text[-3000:]}" for name, text in logs.items())
