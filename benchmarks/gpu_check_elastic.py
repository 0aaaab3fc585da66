"""The elastic pools and the planner's swap on the device (gpu_check.py's `elastic` check):
`pdserve serve` with one colocated worker on the device, two clients sending greedy
requests back to back, then what the SLO planner does to split and to merge, through
`pdserve scale` -- a prefill and a decode worker added on the same device (their KV
transfer chosen for it: cuda_ipc on a GPU, joined after start), the colocated worker
drained; then a colocated worker added and the pair drained. Every output must equal
transformers' greedy one, no request may fail, each new worker must take traffic, the
drained ones exit 0, and the last worker's blocks are back to baseline."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from benchmarks.harness.servers import REPO, log, repo_pythonpath, start_pdserve

STREAMS = 2
PER_PHASE = 8  # requests each layout must finish before the next change


def check_elastic(args, models, hf_greedy, prompts_for, max_new: int) -> dict:
    d = models["small-qwen3"]
    prompts = prompts_for(d)[:8]
    want = {tuple(p): out for p, out in zip(prompts, hf_greedy(d, prompts, max_new, args.device))}
    with tempfile.TemporaryDirectory() as tmp:
        s = start_pdserve("colocated", d, Path(tmp), extra=["--colocated-devices", args.device])
        results: list = []
        halt = threading.Event()
        clients = [threading.Thread(target=_stream, args=(s.url, prompts, max_new, results, halt, k))
                   for k in range(STREAMS)]
        phases: list[dict] = []
        try:
            for c in clients:
                c.start()
            _wait_done(results, PER_PHASE, s)
            pools = _scale(s, "--prefill", "+1", "--decode", "+1")
            pair = [w["worker_id"] for w in pools if w["role"] in ("prefill", "decode") and w["state"] == "serving"]
            phases.append({"step": "split: +1 prefill, +1 decode", "pools": pools})
            phases.append({"step": "split: drain colocated-0", "pools": _scale(s, "--drain", "--worker", "colocated-0")})
            _wait_done(results, PER_PHASE, s)
            routed_pair = _routed(s, pair)
            merged = _scale(s, "--colocated", "+1")
            new = [w["worker_id"] for w in merged if w["role"] == "colocated" and w["state"] == "serving"]
            phases.append({"step": "merge: +1 colocated", "pools": merged})
            drain = [a for w in pair for a in ("--worker", w)]
            phases.append({"step": "merge: drain the pair", "pools": _scale(s, "--drain", *drain)})
            _wait_done(results, PER_PHASE, s)
            halt.set()
            for c in clients:
                c.join(180)
            routed_new = _routed(s, new)
            blocks = _blocks_free(s, new)
        finally:
            halt.set()
            s.stop()
    wrong = [{"prompt_len": len(p), "got": r.get("token_ids"), "error": r.get("error")}
             for p, r in results if r.get("error") or r.get("token_ids") != want[tuple(p)]]
    exited = [w for w in phases[-1]["pools"] if w["state"] == "exited"] if len(phases) == 4 else []
    out = {"requests": len(results), "wrong_or_failed": wrong[:5], "num_wrong_or_failed": len(wrong),
           "pair": pair, "routed_to_pair": routed_pair, "new_colocated": new, "routed_to_new_colocated": routed_new,
           "drained_exit_codes": {w["worker_id"]: w.get("exit_code") for w in exited},
           "blocks_free_total": blocks, "phases": phases, "command": s.cmd}  # type: ignore[attr-defined]
    out["ok"] = (not wrong and len(pair) == 2 and all(v > 0 for v in routed_pair.values()) and len(new) == 1
                 and all(v > 0 for v in routed_new.values()) and len(exited) == 3
                 and all(c == 0 for c in out["drained_exit_codes"].values())
                 and all(f == t for f, t in blocks.values()))
    return out


def _stream(url: str, prompts, max_new: int, results: list, halt: threading.Event, offset: int) -> None:
    i = offset
    while not halt.is_set():
        p = prompts[i % len(prompts)]
        body = json.dumps({"prompt": p, "max_tokens": max_new, "temperature": 0}).encode()
        req = urllib.request.Request(url + "/completions", body, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                results.append((p, {"token_ids": json.loads(r.read())["choices"][0]["token_ids"]}))
        except Exception as e:  # a failed request is recorded and fails the check
            results.append((p, {"error": f"{type(e).__name__}: {e}"}))
        i += STREAMS


def _wait_done(results: list, n: int, s, timeout_s: float = 120) -> None:
    start, deadline = len(results), time.monotonic() + timeout_s
    while len(results) < start + n:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{n} requests did not finish in {timeout_s} s:\n{s.log_path.read_text()[-3000:]}")
        time.sleep(0.1)


def _scale(s, *flags: str) -> list[dict]:
    cmd = [sys.executable, "-m", "pdserve", "scale", "--router", s.info["control"],
           "--secret-file", s.info["secret_file"], "--json", "--wait", "180", *flags]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=240,
                         env={**os.environ, "PYTHONPATH": repo_pythonpath()})
    if out.returncode != 0:
        raise RuntimeError(f"pdserve scale {' '.join(flags)} failed ({out.returncode}): {out.stderr[-2000:]}\n"
                           f"{s.log_path.read_text()[-3000:]}")
    log(f"  scale {' '.join(flags)}: {out.stderr.strip()[-300:]}")
    return json.loads(out.stdout)


def _metrics(s) -> dict[tuple[str, str], float]:
    base = s.url.rsplit("/v1", 1)[0]
    text = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    found = {}
    for m in re.finditer(r'^(pdserve_worker_\w+)\{([^}]*)\} ([\d.e+-]+)$', text, re.M):
        wid = re.search(r'worker_id="([\w-]+)"', m.group(2))
        if wid:
            found[(m.group(1), wid.group(1))] = float(m.group(3))
    return found


def _routed(s, workers: list[str]) -> dict[str, int]:
    health = json.loads(urllib.request.urlopen(s.url.rsplit("/v1", 1)[0] + "/health", timeout=10).read())
    return {w: int(health["pools"].get(w, {}).get("routed", 0)) for w in workers}


def _blocks_free(s, workers: list[str], timeout_s: float = 30) -> dict[str, tuple]:
    """(free, total) blocks of each worker, once all are free or `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = _metrics(s)
        got = {w: (m.get(("pdserve_worker_free_blocks", w)), m.get(("pdserve_worker_total_blocks", w)))
               for w in workers}
        if all(f is not None and f == t for f, t in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.3)
