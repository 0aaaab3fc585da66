"""Helpers for the fault-tolerance tests: a real `pdserve serve` with short liveness
timeouts and faults injected through PDSERVE_FAULTS (common/worker/faults.py), requests over
HTTP, and the checks every test ends with: each request's output, block counts back to
baseline on every surviving worker, and no process left behind."""
from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import time
import urllib.request
from pathlib import Path

from tests.support.serving import Served, _alive, _children, start_server, stop_server

MAX_MODEL_LEN = 256
# short timeouts: every failure here is detected within a second or two
FAST = ["--stale-after", "2", "--heartbeat", "0.2", "--peer-timeout", "2", "--router-timeout", "1",
        "--lease", "3", "--drain", "3", "--num-threads", "1"]

MODEL: dict[str, str] = {}  # the session's tiny model dir (tests/reliability/conftest.py sets it)


def serve(workdir: Path, roles: list[str], faults: str = "", extra: tuple[str, ...] = (),
          max_model_len: int = MAX_MODEL_LEN) -> Served:
    old = os.environ.get("PDSERVE_FAULTS")
    os.environ["PDSERVE_FAULTS"] = faults  # Popen copies the environment; the workers inherit it
    try:
        return start_server_with(workdir, [*roles, *FAST, *extra], max_model_len)
    finally:
        if old is None:
            os.environ.pop("PDSERVE_FAULTS", None)
        else:
            os.environ["PDSERVE_FAULTS"] = old


def start_server_with(workdir: Path, args: list[str], max_model_len: int) -> Served:
    return start_server(MODEL["dir"], workdir, args, max_model_len)


def complete(served: Served, prompt_ids: list[int], max_tokens: int, timeout: float = 120) -> dict:
    """A greedy completion over HTTP, streamed (so a resumed stream is what is checked);
    returns {"token_ids", "error"}."""
    body = json.dumps({"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(served.http + "/completions", body, {"Content-Type": "application/json"})
    ids: list[int] = []
    error = None
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        for line in resp:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]
                continue
            for choice in chunk.get("choices", []):
                ids += choice.get("token_ids") or []
    return {"token_ids": ids, "error": error}


def complete_all(served: Served, prompts: list[list[int]], max_tokens: int) -> list[dict]:
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: complete(served, p, max_tokens), prompts))


def metrics(served: Served) -> dict[tuple[str, str], float]:
    """{(metric, worker_id): value} of the per-worker gauges in /metrics."""
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    out = {}
    for m in re.finditer(r'^(pdserve_worker_\w+)\{role="\w+",worker_id="([\w-]+)"\} ([\d.e+-]+)$', text, re.M):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    for m in re.finditer(r'^(pdserve_worker_\w+)\{worker_id="([\w-]+)",role="\w+"\} ([\d.e+-]+)$', text, re.M):
        out[(m.group(1), m.group(2))] = float(m.group(3))
    return out


def recoveries(served: Served) -> dict[str, float]:
    """pdserve_request_recoveries by kind (reprefill, resume)."""
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2))
            for m in re.finditer(r'^pdserve_request_recoveries_total\{kind="(\w+)"\} ([\d.e+-]+)$', text, re.M)}


def health(served: Served) -> dict:
    try:
        return json.loads(urllib.request.urlopen(served.base + "/health", timeout=10).read())
    except urllib.error.HTTPError as e:
        return json.loads(e.read())


def wait_blocks_baseline(served: Served, workers: list[str], timeout: float = 30) -> None:
    """Every named worker reports all its blocks free (cached prefixes count as free)."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(served)
        bad = {w: (m.get(("pdserve_worker_free_blocks", w)), m.get(("pdserve_worker_total_blocks", w)))
               for w in workers}
        bad = {w: v for w, v in bad.items() if v[0] is None or v[0] != v[1]}
        if not bad:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks not back to baseline (free, total): {bad}")
        time.sleep(0.3)


def stop(served: Served) -> None:
    """SIGTERM to serve; every worker still alive must go with it (the killed ones were
    reaped by serve: they are no longer its children)."""
    served.info["workers"] = {n: w for n, w in served.info["workers"].items() if _alive(w["pid"])}
    stop_server(served, signal.SIGTERM)


def kill_worker(served: Served, name: str) -> int:
    pid = served.info["workers"][name]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def wait_gone(pids: list[int], timeout: float) -> float:
    """Seconds until every pid is gone; AssertionError if one outlives `timeout`."""
    start = time.monotonic()
    while any(_alive(p) for p in pids):
        if time.monotonic() - start > timeout:
            raise AssertionError(f"processes {[p for p in pids if _alive(p)]} still alive after {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - start


__all__ = ["FAST", "Served", "complete", "complete_all", "health", "kill_worker", "metrics", "recoveries", "serve",
           "stop", "stop_server", "wait_blocks_baseline", "wait_gone", "_children"]
