"""Conditional disaggregation end to end: `pdserve serve --prefill 1 --decode 1 --disagg
threshold` prefills a short prompt on the decode worker and sends a long one through the
prefill worker, both in flight at once; a long prompt whose prefix D already holds counts
only its uncached part. Greedy output equals transformers' either way; timelines and
/metrics say which way each went; every block comes back."""
from __future__ import annotations

import random
import re
import urllib.request

import pytest

from tests.support.reliability_harness import wait_blocks_baseline
from tests.support.serving import MAX_MODEL_LEN, RawClient, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

THRESHOLD = 32
MAX_NEW = 10
LOCAL_ONLY = {"decode_reserved", "transfer_start", "transfer_end", "kv_ready"}  # stamps of a disaggregated prompt


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    s = start_server(model_dir, tmp_path_factory.mktemp("disagg_threshold"), ["--prefill", "1", "--decode", "1"],
                     MAX_MODEL_LEN, extra=("--disagg", "threshold", "--disagg-threshold-tokens", str(THRESHOLD)))
    yield s
    stop_server(s)


def decisions(served) -> dict[tuple[str, str], float]:
    text = urllib.request.urlopen(served.base + "/metrics", timeout=10).read().decode()
    pattern = r'^pdserve_disagg_decisions_total\{decision="(\w+)",reason="(\w+)"\} ([\d.e+-]+)$'
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(pattern, text, re.M)}


def run(client: RawClient, prompts: list[list[int]]) -> list[tuple[list[int], dict]]:
    """All prompts in flight at once; per prompt its tokens and final timeline."""
    rids = [client.submit({"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True}, prompt_token_ids=p,
                          return_timeline=True) for p in prompts]
    out = []
    for rid in rids:
        msgs = client.until_done(rid)
        assert all(m["type"] == "token_output" for m in msgs), msgs[-1]
        out.append(([t for m in msgs for t in m["data"]["token_ids"]], msgs[-1]["data"]["timeline"]))
    return out


def test_short_on_decode_long_via_prefill_token_exact(served, vocab_size, hf_greedy):
    rng = random.Random(5)
    short = [rng.randrange(3, vocab_size) for _ in range(THRESHOLD - 7)]
    long = [rng.randrange(3, vocab_size) for _ in range(3 * THRESHOLD + 5)]
    client = RawClient(served.zmq)
    try:
        (got_short, tl_short), (got_long, tl_long) = run(client, [short, long])
        # D now holds long's full blocks: long + a few tokens lacks fewer than THRESHOLD there
        follow = long + [rng.randrange(3, vocab_size) for _ in range(9)]
        ((got_follow, tl_follow),) = run(client, [follow])
    finally:
        client.close()
    for prompt, got in ((short, got_short), (long, got_long), (follow, got_follow)):
        assert got == hf_greedy(served.model_dir, prompt, MAX_NEW), f"prompt of {len(prompt)} tokens"
    for tl in (tl_short, tl_follow):  # prefilled on D: no reservation, no transfer
        assert "route_local" in tl and "route_disagg" not in tl and not LOCAL_ONLY & set(tl), tl
        assert tl["route_local"] == tl["routed"] <= tl["prefill_start"] <= tl["prefill_end"] <= tl["first_token"]
    assert "route_disagg" in tl_long and "route_local" not in tl_long and LOCAL_ONLY <= set(tl_long), tl_long
    assert decisions(served) == {("local", "short_prompt"): 2.0, ("disagg", "long_prompt"): 1.0}
    wait_blocks_baseline(served, ["prefill-0", "decode-0"])


@pytest.fixture(scope="module")
def vocab_size(model_dir) -> int:
    from pdserve.common.config import ModelConfig
    return ModelConfig.from_dir(model_dir).vocab_size


def test_serve_refuses_a_bad_latency_model_before_starting_workers(model_dir, tmp_path):
    import subprocess
    import sys

    from tests.support.serving import ROOT
    bad = tmp_path / "lm.json"
    bad.write_text('{"schema": "pdserve-latency-model/1", "prefill": {"points": [[1, 0.1], [2, 0.2]]}}')
    done = subprocess.run([sys.executable, "-m", "pdserve", "serve", model_dir, "--http-port", "0", "--zmq-port", "0",
                           "--disagg", "cost", "--disagg-latency-model", str(bad), "--ready-file", str(tmp_path / "r")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and f"latency model '{bad}': missing 'decode'" in done.stderr, done.stderr
    assert not (tmp_path / "r").exists()
