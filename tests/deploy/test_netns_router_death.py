"""The router's host dies; the cluster does not. The router (`pdserve router`), a prefill
worker and a decode worker (`pdserve worker --join`, tcp KV, CurveZMQ on) each in a
network namespace of its own (tests/support/netns.py), the client in the router's. After
greedy traffic, with two long streams still running, the router's host dies: its cable
is pulled and every process in it (router and client) SIGKILLed. The workers hear no
reset; their pings to the router go unanswered (--router-timeout), they give up the
streams of the dead router and free their blocks, and keep waiting (--rejoin-timeout).
The cable goes back in and a new router starts at the same address and port with the
same secret: both workers register with it on their own (never restarted), its /health
shows them, and a fresh client's requests are served equal to transformers at float32;
every block on P and D is free again. A third worker (x, a prefill worker given a short
--rejoin-timeout) shows the bound: the new router starts only once x has exited, with
code 3, saying why -- so x can never rejoin in time, whatever the machine's speed.

Needs root (CI runs as root): without the privilege it FAILS, saying so."""
from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from pdserve.common.text.tokenizer import Tokenizer
from pdserve.common.worker.router_link import EXIT_ROUTER_LOST
from tests.support.netns import (CLIENT_PRELUDE, HTTP, Hosts, read_logs, start_cluster, start_router, start_worker,
                                tails, wait_router_ready, write_secret)
from tests.support.helpers import one_torch_thread

WORKERS = {"p": "prefill", "d": "decode"}
QUITTER = "x"  # a prefill worker that waits less than the router's restart takes
TEXTS = ["Hello there", "The router died and came back"]
MAX_TOKENS = 8
LONG_TOKENS = 200  # the streams in flight when the router dies: ~20 s at d's pace, so only an abort frees them soon
ROUTER_TIMEOUT_S, REJOIN_TIMEOUT_S, QUITTER_REJOIN_S = 3, 120, 2  # 120: a router starts slowly on a loaded machine
ROUTER_FLAGS = ("--stale-after", "5", "--num-threads", "1", "--max-model-len", "256")
WORKER_FLAGS = ("--heartbeat", "0.25", "--router-timeout", str(ROUTER_TIMEOUT_S), "--rejoin-timeout",
                str(REJOIN_TIMEOUT_S), "--num-threads", "1", "--max-model-len", "256")
FAULTS = "delay_step_ms=100@d"  # d's streams outlast the router

CLIENT = CLIENT_PRELUDE + r"""
import threading
base, model, prompts, max_tokens, mode = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
prefill = 2 if mode == "stream" else 1  # p and x, then p alone

def complete(ids, n, stream=False):
    body = {"model": model, "prompt": ids, "max_tokens": n, "temperature": 0, "ignore_eos": stream, "stream": stream}
    req = urllib.request.Request(base + "/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"})
    return urllib.request.urlopen(req, timeout=60)

live = lambda: json.loads(get("/health"))["workers"] == {"prefill": prefill, "decode": 1, "colocated": 0}
if not wait(live, f"waiting for {prefill} prefill and 1 decode worker", 300):
    sys.exit("the router never had its workers")
outs = []
for ids in prompts:
    with complete(ids, max_tokens) as r:
        outs.append(json.load(r)["choices"][0]["token_ids"])
print("results " + json.dumps(outs), flush=True)
if mode == "stream":  # two long streams, left running: this host dies under them
    started = threading.Semaphore(0)
    def stream(ids):
        with complete(ids, int(sys.argv[6]), stream=True) as r:
            first = True
            for line in r:
                if first and line.startswith(b"data: {"):  # its first token: it runs on d
                    first = False
                    started.release()
    for ids in prompts:
        threading.Thread(target=stream, args=(ids,), daemon=True).start()
    for _ in prompts:
        started.acquire()
    print("streaming", flush=True)
    time.sleep(600)
baseline = lambda: all(f is not None and f == t for f, t in free_blocks(["p", "d"]).values())
if not wait(baseline, "waiting for every block of p and d to be free", 30):
    sys.exit("blocks held on p or d")
print("final " + json.dumps({"health": json.loads(get("/health")), "blocks": free_blocks(["p", "d"])}), flush=True)
"""


def _client(hosts: Hosts, addr: str, model: str, prompts: list[list[int]], mode: str, log: Path) -> subprocess.Popen:
    return hosts.run("router", [sys.executable, "-c", CLIENT, f"http://{addr}:{HTTP}", Path(model).name,
                                json.dumps(prompts), str(MAX_TOKENS), mode, str(LONG_TOKENS)], log,
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _said(proc: subprocess.Popen, until: str, context) -> dict[str, str]:
    """The client's lines by their first word, read until one starts with `until`."""
    said = {}
    for line in proc.stdout:
        word, _, rest = line.rstrip("\n").partition(" ")
        said[word] = rest
        if word == until:
            return said
    proc.wait(10)
    raise AssertionError(f"the client ended before {until!r}: {said}\n{proc.stderr.read()}\n{context()}")


def test_workers_outlive_the_router_host_and_rejoin_a_new_router(model_dirs, hf_greedy, tmp_path, monkeypatch):
    model = model_dirs["qwen3"]
    prompts = [Tokenizer(model).encode(t) for t in TEXTS]
    monkeypatch.setenv("PDSERVE_FAULTS", FAULTS)  # the workers' environment
    common = ["--secret-file", write_secret(tmp_path / "secret"), "--dtype", "float32", "--curve", "on"]
    hosts = Hosts()
    try:
        addr = hosts.open(["router", *WORKERS, QUITTER])
        procs = start_cluster(hosts, model, addr, WORKERS, tmp_path, common, ROUTER_FLAGS, WORKER_FLAGS)
        wait_router_ready(tmp_path / "router.log", procs["router"])  # x's 2 s would not outlast a slow start
        procs[QUITTER] = start_worker(hosts, model, addr, QUITTER, "prefill", tmp_path,
                                      [*common, *WORKER_FLAGS, "--rejoin-timeout", str(QUITTER_REJOIN_S)])
        context = lambda: tails(read_logs(tmp_path, procs))  # noqa: E731
        with one_torch_thread():  # while the cluster starts
            want = [hf_greedy(model, ids, MAX_TOKENS) for ids in prompts]
        first = _client(hosts, addr["router"], model, prompts, "stream", tmp_path / "client1.log")
        said = _said(first, "streaming", context)
        assert json.loads(said["results"]) == want, context()

        hosts.kill("router")  # the router's host dies: cable out, router and client SIGKILLed
        first.wait(10)
        down = time.monotonic()
        code = procs[QUITTER].wait(QUITTER_REJOIN_S + 3 * ROUTER_TIMEOUT_S + 30)  # no router: x gives up
        waited = time.monotonic() - down
        logs = read_logs(tmp_path, procs)
        assert code == EXIT_ROUTER_LOST and waited >= QUITTER_REJOIN_S, (code, waited, logs[QUITTER][-3000:])
        assert f"no router reachable at tcp://{addr['router']}:" in logs[QUITTER], logs[QUITTER][-3000:]
        hosts.reconnect("router")
        procs["router2"] = start_router(hosts, model, addr["router"], tmp_path / "router2.log", common, ROUTER_FLAGS)
        second = _client(hosts, addr["router"], model, prompts, "after", tmp_path / "client2.log")
        said = _said(second, "final", context)
        second.wait(10)
        assert json.loads(said["results"]) == want, context()
        final = json.loads(said["final"])
        assert final["health"]["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}, final
        assert {w: final["health"]["pools"][w]["state"] for w in WORKERS} == {"p": "serving", "d": "serving"}, final
        assert all(free == total for free, total in final["blocks"].values()), final["blocks"]
        logs = read_logs(tmp_path, procs)
        for name in WORKERS:
            assert procs[name].poll() is None, f"{name} exited:\n{logs[name][-3000:]}"
            assert "reachable again: saying hello" in logs[name], logs[name][-3000:]
        assert f"unreachable for {ROUTER_TIMEOUT_S} s: gave up the 2 request(s)" in logs["d"], logs["d"][-3000:]
    finally:
        hosts.close()
    assert not hosts.leftover()
