"""Speculative decoding under `pdserve serve --speculative-config`: a decode worker killed
mid-stream while it speculates (several tokens per step reach the router at once) has its
streams resumed elsewhere from prompt + tokens streamed, with the uninterrupted run's greedy
output; the router's /metrics counts the verifications under vLLM's spec_decode names."""
from __future__ import annotations

import json
import re
import urllib.request

from tests.support.reliability_harness import complete_all, recoveries, serve, stop, wait_blocks_baseline

MAX_NEW = 24
SPEC = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3,
        "adaptive": False}


def _spec_metrics(served) -> dict[str, float]:
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    return {m.group(1): float(m.group(2)) for m in
            re.finditer(r'^vllm:spec_decode_(num_\w+?)(?:_total)?\{model_name="[^"]*"\} ([\d.e+-]+)$', text, re.M)}


def test_kill_a_speculating_decode_worker_resumes_exactly(tmp_path, prompts, greedy):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2", "--routing", "round_robin"],
                   faults="kill_mid_decode=20@decode-0,delay_step_ms=30@decode-0",
                   extra=("--speculative-config", json.dumps(SPEC)))
    try:
        some = prompts[:4]
        results = complete_all(served, some, MAX_NEW)
        for ids, res in zip(some, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert recoveries(served).get("resume", 0) >= 1
        counts = _spec_metrics(served)
        assert 0 < counts["num_accepted_tokens"] <= counts["num_draft_tokens"], counts
        assert counts["num_drafts"] > 0, counts
        wait_blocks_baseline(served, ["prefill-0", "decode-1"])
    finally:
        stop(served)
