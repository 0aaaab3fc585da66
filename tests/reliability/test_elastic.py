"""Elastic pools under a steady stream (docs/deploy.md "Growing and shrinking pools"):
`pdserve scale --prefill +1 --decode -1` against `pdserve serve --prefill 1 --decode 2`,
then `--role-of prefill-1=decode`. No request fails or is cut (none resumed or
re-prefilled), every output equals transformers' greedy one, the new prefill worker
serves, the removed decode worker exits with code 0, the re-roled worker serves as a
decode worker, /health and /metrics show the pools, and blocks are back to baseline."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
import urllib.request

from tests.support.reliability_harness import complete, health, recoveries, serve, stop, wait_blocks_baseline, wait_gone
from tests.support.serving import ROOT

MAX_NEW = 16
STREAMS = 2  # requests in flight at once, each client sending the next as soon as one ends


def _stream(served, prompts, results: list, stop: threading.Event, offset: int) -> None:
    i = offset
    while not stop.is_set():
        ids = prompts[i % len(prompts)]
        try:
            results.append((ids, complete(served, ids, MAX_NEW, timeout=60)))
        except Exception as e:  # an HTTP error is a failed request: recorded, checked below
            results.append((ids, {"token_ids": [], "error": f"{type(e).__name__}: {e}"}))
        i += STREAMS


def _scale(served, *flags: str) -> list[dict]:
    cmd = [sys.executable, "-m", "pdserve", "scale", "--router", served.info["control"],
           "--secret-file", served.info["secret_file"], "--json", "--wait", "120", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert out.returncode == 0, f"pdserve scale failed ({out.returncode}):\n{out.stderr}\n{served.log_tail()}"
    return json.loads(out.stdout)


def test_scale_prefill_up_and_decode_down_under_a_steady_stream(tmp_path, prompts, greedy):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2"])
    try:
        results: list = []
        halt = threading.Event()
        clients = [threading.Thread(target=_stream, args=(served, prompts, results, halt, k)) for k in range(STREAMS)]
        for c in clients:
            c.start()
        try:
            time.sleep(1.0)
            before = len(results)
            pools = {w["worker_id"]: w for w in _scale(served, "--prefill", "+1", "--decode", "-1")}
            (gone,) = [w for w in pools.values() if w["state"] == "exited"]
            (new,) = [w for w in pools.values() if w["role"] == "prefill" and w["worker_id"] != "prefill-0"]
            assert gone["role"] == "decode" and gone["exit_code"] == 0 and gone["managed"], pools
            assert gone["routed"] > 0, "the removed worker served nothing before its drain"
            assert new["state"] == "serving"
            _wait_routed(served, new["worker_id"])  # it takes traffic once registered
            mid = len(results)
            pools = {w["worker_id"]: w for w in _scale(served, "--role-of", f"{new['worker_id']}=decode")}
            assert (pools[new["worker_id"]]["role"], pools[new["worker_id"]]["state"]) == ("decode", "serving")
            _wait_routed(served, new["worker_id"])
            time.sleep(0.5)
        finally:
            halt.set()
            for c in clients:
                c.join(120)
        assert len(results) > mid > before > 0, "the stream did not run across the scaling"
        for ids, res in results:
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert recoveries(served) == {}, "a request was cut and re-routed instead of drained"
        wait_gone([served.info["workers"][gone["worker_id"]]["pid"]], 5)
        h = health(served)
        assert h["workers"] == {"prefill": 1, "decode": 2, "colocated": 0}, h
        assert gone["worker_id"] not in h["pools"] and h["pools"][new["worker_id"]]["role"] == "decode"
        text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
        assert re.search(r'^pdserve_pool_workers\{role="prefill",state="serving"\} 1\.0$', text, re.M), text
        assert re.search(r'^pdserve_pool_workers\{role="decode",state="serving"\} 2\.0$', text, re.M)
        kept = [w for w, v in h["pools"].items() if v["state"] == "serving"]
        wait_blocks_baseline(served, kept)
    finally:
        stop(served)


def _wait_routed(served, worker_id: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while health(served)["pools"][worker_id]["routed"] == 0:
        assert time.monotonic() < deadline, f"{worker_id} served nothing:\n{served.log_tail()}"
        time.sleep(0.2)
