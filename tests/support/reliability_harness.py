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
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Callable

from tests.support.serving import ROOT, Served, _alive, _children, start_server, stop_server

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
    return stream_completion(served.http, {"prompt": prompt_ids, "max_tokens": max_tokens, "temperature": 0,
                                           "ignore_eos": True}, timeout=timeout, catch=False)


def stream_completion(http: str, body: dict, on_tokens: Callable[[], object] | None = None, timeout: float = 120,
                      catch: bool = True) -> dict:
    """POST `body` streamed to `http` (the /v1 URL) + /completions; {"token_ids", "error"}:
    an error event's error, or (`catch`) an HTTP error or a cut stream as text.
    `on_tokens()` runs at each chunk that brought tokens."""
    req = urllib.request.Request(http + "/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    ids: list[int] = []
    error = None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            for line in resp:
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                error = error or chunk.get("error")
                new = [t for choice in chunk.get("choices", []) for t in choice.get("token_ids") or []]
                ids += new
                if new and on_tokens is not None:
                    on_tokens()
    except Exception as e:  # the client saw an error
        if not catch:
            raise
        error = f"{type(e).__name__}: {e}"
    return {"token_ids": ids, "error": error}


class Streams:
    """Streamed greedy completions at `http` (the /v1 URL), one thread each, started at once;
    `first` is set at the first token any of them receives. Each result: {"token_ids",
    "error"} (an HTTP error or a cut stream is an error). EOS ends each, as transformers'
    generate."""

    def __init__(self, http: str, prompts: list[list[int]], max_tokens: int = 16) -> None:
        self.results: list[dict | None] = [None] * len(prompts)
        self.first = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(http, i, p, max_tokens))
                        for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, http: str, i: int, prompt: list[int], max_tokens: int) -> None:
        self.results[i] = stream_completion(http, {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                                            self.first.set)

    def join(self) -> list[dict]:
        for t in self.threads:
            t.join(180)
        assert all(r is not None for r in self.results), "a stream hangs"
        return self.results  # type: ignore[return-value]


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


def counters(served: Served, name: str) -> dict[str, float]:
    """A labelled metric of /metrics by its one label's value ({"": v} for an unlabelled one)."""
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf'^{re.escape(name)}(?:\{{\w+="([\w-]+)"\}})? ([\d.e+-]+)$', text, re.M)}


def scale(served: Served, *flags: str) -> list[dict]:
    """`pdserve scale` against the deployment (docs/deploy.md); the pools as it prints them."""
    cmd = [sys.executable, "-m", "pdserve", "scale", "--router", served.info["control"],
           "--secret-file", served.info["secret_file"], "--json", "--wait", "120", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, f"pdserve scale failed ({out.returncode}):\n{out.stderr}\n{served.log_tail()}"
    return json.loads(out.stdout)


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


__all__ = ["FAST", "Served", "Streams", "complete", "stream_completion", "complete_all", "counters", "health", "kill_worker", "metrics", "recoveries",
           "scale", "serve", "stop", "stop_server", "wait_blocks_baseline", "wait_gone", "_children"]
