"""kill -9 of a worker with requests in flight: every request completes with the greedy
output of the uninterrupted run (transformers' generate), the dead worker leaves /metrics
and /health names it, and every surviving worker's blocks return to baseline."""
from __future__ import annotations

import time

from tests.support.reliability_harness import complete_all, health, metrics, recoveries, serve, stop, wait_blocks_baseline

MAX_NEW = 16
DEAD_WITHIN_S = 10.0  # the harness's --stale-after 2 s bounds it; the launcher's poll usually says it in 0.2 s


def named_dead(served, worker_id: str) -> dict:
    """/health once it names `worker_id` dead (the requests can all finish, re-routed,
    before the death is recorded), or as it is after DEAD_WITHIN_S."""
    deadline = time.monotonic() + DEAD_WITHIN_S
    while worker_id not in (h := health(served))["dead"] and time.monotonic() < deadline:
        time.sleep(0.1)
    return h


def test_kill_prefill_mid_prefill_while_decode_full(tmp_path, prompts, greedy):
    """prefill-0 dies after its first prefill, before KVReady; the decode worker takes two
    sequences at a time (--max-num-seqs 2), so most requests wait for room while it dies."""
    served = serve(tmp_path, ["--prefill", "2", "--decode", "1", "--routing", "round_robin", "--max-num-seqs", "2"],
                   faults="kill_after_prefill=1@prefill-0")
    try:
        results = complete_all(served, prompts, MAX_NEW)
        for ids, res in zip(prompts, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert recoveries(served).get("reprefill", 0) >= 1
        h = named_dead(served, "prefill-0")
        assert h["dead"] == ["prefill-0"] and h["status"] == "ok", h
        assert not any(w == "prefill-0" for _, w in metrics(served)), "a dead worker's gauges stay in /metrics"
        wait_blocks_baseline(served, ["prefill-1", "decode-0"])
    finally:
        stop(served)


def test_kill_decode_mid_decode_resumes(tmp_path, prompts, greedy):
    """decode-0 dies at its 20th token: its streams resume on decode-1 from prompt + tokens
    streamed so far, nothing repeated, nothing dropped. Its steps are slowed (30 ms) so that
    both of its streams are under way when it dies: at full speed the first could finish
    before the second had streamed a token, which then re-prefills instead."""
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2", "--routing", "round_robin"],
                   faults="kill_mid_decode=20@decode-0,delay_step_ms=30@decode-0")
    try:
        some = prompts[:4]
        results = complete_all(served, some, MAX_NEW)
        for ids, res in zip(some, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert recoveries(served).get("resume", 0) >= 1
        assert named_dead(served, "decode-0")["dead"] == ["decode-0"]
        wait_blocks_baseline(served, ["prefill-0", "decode-1"])
    finally:
        stop(served)
