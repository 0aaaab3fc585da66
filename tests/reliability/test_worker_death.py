"""kill -9 of a worker with requests in flight: every request completes with the greedy
output of the uninterrupted run (transformers' generate), the dead worker leaves /metrics
and /health names it, and every surviving worker's blocks return to baseline."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

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


# a speculating decode worker (several tokens a step reach the router at once): its int8 copy
# drafts 3 tokens every step; /metrics counts the verifications under vLLM's spec_decode names
SPEC = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3,
        "adaptive": False}


def _spec_metrics(served) -> dict[str, float]:
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^vllm:spec_decode_(num_\w+?)(?:_total)?\{model_name="[^"]*"\} ([\d.e+-]+)$', text, re.M)}


@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "speculating"])
def test_kill_decode_mid_decode_resumes(tmp_path, prompts, greedy, spec):
    """decode-0 dies at its 20th token: its streams resume on decode-1 from prompt + tokens
    streamed so far, nothing repeated, nothing dropped. Its steps are slowed (30 ms) so that
    both of its streams are under way when it dies: at full speed the first could finish
    before the second had streamed a token, which then re-prefills instead."""
    max_new = 24 if spec else MAX_NEW
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2", "--routing", "round_robin"],
                   faults="kill_mid_decode=20@decode-0,delay_step_ms=30@decode-0",
                   extra=("--speculative-config", json.dumps(spec)) if spec else ())
    try:
        some = prompts[:4]
        results = complete_all(served, some, max_new)
        for ids, res in zip(some, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, max_new)
        assert recoveries(served).get("resume", 0) >= 1
        assert named_dead(served, "decode-0")["dead"] == ["decode-0"]
        if spec:
            counts = _spec_metrics(served)
            assert 0 < counts["num_accepted_tokens"] <= counts["num_draft_tokens"], counts
            assert counts["num_drafts"] > 0, counts
        wait_blocks_baseline(served, ["prefill-0", "decode-1"])
    finally:
        stop(served)
