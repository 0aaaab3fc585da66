"""A host dies mid-traffic: the router, two prefill hosts (p1, p2) and two decode hosts
(d1, d2), each its own network namespace (tests/support/netns.py). A client in the
router's namespace streams greedy requests, a few in flight at once, in two phases. In
the first, p1's cable is pulled and its processes SIGKILLed; the second starts once the
router has found p1 dead, and d1 dies the same way in it. Nobody hears a reset, so the
router and the peers learn of a death only by silence (short `--stale-after`,
`--peer-timeout`, `--lease`). d1 decodes slowly (the `delay_step_ms` fault), so when it
dies its streams are likely half-way (they resume on d2; a request without a token yet is
prefilled again). Every request completes with the offline engine's output at float32 (a
resumed stream included), /health ends with p1 and d1 dead and p2, d2 serving, and every
block on p2 and d2 is free again afterwards.

Needs root (CI runs as root): without the privilege it FAILS, saying so."""
from __future__ import annotations

import json
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

from pdserve.common import LLM, SamplingParams
from tests.support.netns import CLIENT_PRELUDE, HTTP, Hosts, read_logs, start_cluster, tails, write_secret

WORKERS = {"p1": "prefill", "p2": "prefill", "d1": "decode", "d2": "decode"}
JOBS = [(f"Request {i} asks the cluster to keep going although hosts die", 16 + i % 9) for i in range(24)]
PHASES = [JOBS[:12], JOBS[12:]]
IN_FLIGHT = 4
KILL_AT = {(0, 3): "p1", (1, 3): "d1"}  # (phase, requests completed in it) -> the host that dies then
ROUTER_FLAGS = ("--stale-after", "3", "--num-threads", "1")
WORKER_FLAGS = ("--heartbeat", "0.25", "--peer-timeout", "4", "--lease", "8", "--num-threads", "1")
FAULTS = "delay_step_ms=100@d1"  # d1's streams outlast d2's: it has some half-way when it dies

CLIENT = CLIENT_PRELUDE + r"""
import concurrent.futures
base, model, phases, in_flight = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), int(sys.argv[4])

def complete(job):
    prompt, max_tokens = job
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(base + "/v1/completions", body, {"content-type": "application/json"})
    ids, error = [], None
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            for line in resp:
                line = line.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                error = chunk.get("error", error)
                for choice in chunk.get("choices", []):
                    ids += choice.get("token_ids") or []
    except Exception as e:  # a hung or cut stream is a result too
        error = repr(e)
    print("done", flush=True)
    return {"token_ids": ids, "error": error}

four = lambda: json.loads(get("/health"))["workers"] == {"prefill": 2, "decode": 2, "colocated": 0}
if not wait(four, "waiting for 2 prefill and 2 decode workers", 240):
    sys.exit("the router never had its four workers")
results = []
for i, jobs in enumerate(phases):  # each later phase starts once one more worker is dead
    dead = lambda: len(json.loads(get("/health"))["dead"]) >= i
    if not wait(dead, f"waiting for {i} dead worker(s)", 30):
        sys.exit("the router never found the dead host")
    print(f"phase {i}", flush=True)
    with concurrent.futures.ThreadPoolExecutor(in_flight) as pool:
        results += pool.map(complete, jobs)
print("results " + json.dumps(results), flush=True)
gone = lambda: {"p1", "d1"} <= set(json.loads(get("/health"))["dead"])
wait(gone, "waiting for p1 and d1 to be dead", 30)
baseline = lambda: all(f is not None and f == t for f, t in free_blocks(["p2", "d2"]).values())
wait(baseline, "waiting for the blocks of p2 and d2", 30)
print("final " + json.dumps({"health": json.loads(get("/health")), "blocks": free_blocks(["p2", "d2"]),
                             "metrics": get("/metrics").decode()}), flush=True)
"""


def lines(proc: subprocess.Popen) -> queue.Queue:
    """The client's stdout, line by line, on a queue (None at its end)."""
    out: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            out.put(line.rstrip("\n"))
        out.put(None)
    threading.Thread(target=pump, daemon=True).start()
    return out


def inflight(hosts: Hosts, router: str, name: str) -> int:
    """Requests the router has in flight on worker `name` (its /health, read from inside
    the router's namespace)."""
    read = ("import json, sys, urllib.request; "
            "print(json.load(urllib.request.urlopen(sys.argv[1], timeout=5))['pools'][sys.argv[2]]['inflight'])")
    done = subprocess.run([*hosts.inside("router"), sys.executable, "-c", read, f"http://{router}:{HTTP}/health", name],
                          capture_output=True, text=True, timeout=30)
    return int(done.stdout.strip() or 0)


def drive(hosts: Hosts, out: queue.Queue, busy) -> dict[str, str]:
    """Reads the client's progress, killing each host of KILL_AT when its phase has
    completed that many requests and `busy(host)` says it holds a request (waiting up to
    20 s for that, so a death hits a request whenever the host gets one); returns the client's
    last lines by their first word (phase, results, final, ...)."""
    phase, done, said = -1, 0, {}
    while (line := out.get(timeout=300)) is not None:
        word, _, rest = line.partition(" ")
        said[word] = rest
        if word == "phase":
            phase, done = int(rest), 0
        done += word == "done"
        if word == "done" and (phase, done) in KILL_AT:
            name = KILL_AT[phase, done]
            deadline = time.monotonic() + 20
            while not (held := busy(name)) and time.monotonic() < deadline:
                time.sleep(0.1)
            hosts.kill(name)
            said[f"killed {name}"] = f"in phase {phase} holding {held} request(s)"
    return said


def test_prefill_and_decode_hosts_die_mid_traffic(model_dirs, tmp_path, monkeypatch):
    model = model_dirs["qwen3"]
    monkeypatch.setenv("PDSERVE_FAULTS", FAULTS)  # the workers' environment
    common = ["--secret-file", write_secret(tmp_path / "secret"), "--dtype", "float32"]
    hosts = Hosts()
    try:
        addr = hosts.open(["router", *WORKERS])
        procs = start_cluster(hosts, model, addr, WORKERS, tmp_path, common, ROUTER_FLAGS, WORKER_FLAGS)
        client = hosts.run("router", [sys.executable, "-c", CLIENT, f"http://{addr['router']}:{HTTP}",
                                      Path(model).name, json.dumps(PHASES), str(IN_FLIGHT)], tmp_path / "client.log",
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        said = drive(hosts, lines(client), lambda name: inflight(hosts, addr["router"], name))
        client.wait(30)
        logs = read_logs(tmp_path, procs)
        context = f"client said {said}\n{client.stderr.read()}\n{tails(logs)}"
        assert "results" in said and "final" in said and not any(w == "timeout" for w in said), context
        assert all(f"killed {name}" in said for name in KILL_AT.values()), context

        llm = LLM(model, dtype="float32", num_threads=1, num_kv_blocks=256)
        want = llm.generate([p for p, _ in JOBS], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                                   for _, n in JOBS])
        got = json.loads(said["results"])
        assert [r["error"] for r in got] == [None] * len(JOBS), context
        assert [r["token_ids"] for r in got] == [w["token_ids"] for w in want], context

        final = json.loads(said["final"])
        assert {"p1", "d1"} <= set(final["health"]["dead"]), final["health"]
        assert final["health"]["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}, final["health"]
        assert all(final["health"]["pools"][w]["state"] == "serving" for w in ("p2", "d2")), final["health"]
        assert all(free == total for free, total in final["blocks"].values()), final["blocks"]
        # every death that hit a request in flight (drive waits up to 20 s for one) recovered
        # it: a request on d1 resumes on d2 if it had streamed tokens, else it is prefilled again
        hits = sum(not said[f"killed {name}"].endswith("holding 0 request(s)") for name in KILL_AT.values())
        recovered = sum(float(line.rsplit(" ", 1)[1]) for line in final["metrics"].splitlines()
                        if line.startswith("pdserve_request_recoveries_total{"))
        assert hits >= 1 and recovered >= hits, context
        for name in ("router", "p2", "d2"):
            assert procs[name].poll() is None, f"{name} exited:\n{logs[name][-3000:]}"
    finally:
        hosts.close()
    assert not hosts.leftover()
