"""`pdserve serve` with colocated workers: the CLI accepts `--colocated N` alone, the
deployment serves greedy output over HTTP and ZeroMQ, and SIGINT stops it with no worker
process left behind."""
from __future__ import annotations

import contextlib
import signal

import httpx
import openai
import pytest

from tests.support.serving import (CHAT, MAX_MODEL_LEN, MAX_NEW, PROMPTS, chat_ids, check_ready_file_workers,
                                  start_server, stop_server)

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

COLOCATED_TIMELINE = ["arrival", "routed", "decode_arrival", "prefill_queued", "prefill_start", "prefill_end",
                      "first_token", "finish", "router_done"]


def test_colocated_flag_alone_is_accepted(model_dir, monkeypatch):
    """`pdserve serve --colocated 2` (as DESIGN.md and --help spell it) must start two
    colocated workers. The CLI is run up to the point where it would start serving."""
    import pdserve.router.deploy.local as router_serve
    from pdserve.router.cli.main import main
    started = []
    monkeypatch.setattr(router_serve, "run", lambda dep, ready_file="": started.append(dep))
    rc = main(["serve", model_dir, "--colocated", "2", "--http-port", "0", "--zmq-port", "0",
               "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"])
    assert rc == 0 and len(started) == 1, "`--colocated 2` was rejected (see stderr)"
    dep = started[0]
    assert (dep.colocated_devices, dep.prefill_devices, dep.decode_devices) == (("cpu", "cpu"), (), ())


def test_colocated_serves_greedy_and_stops_on_sigint(model_dir, tok, hf_greedy, tmp_path):
    from pdserve.router.client import Client
    # `--prefill 0 --decode 0`: without them the CLI rejects `--colocated` alone, because
    # --prefill and --decode default to 1 (test_colocated_flag_alone_is_accepted)
    served = start_server(model_dir, tmp_path, ["--colocated", "2", "--prefill", "0", "--decode", "0"], MAX_MODEL_LEN)
    try:
        health = httpx.get(f"{served.base}/health").json()
        assert health["workers"] == {"prefill": 0, "decode": 0, "colocated": 2}
        client = openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            want = hf_greedy(model_dir, tok.encode(prompt), MAX_NEW)
            res = client.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
            assert res.choices[0].token_ids == want
        want = hf_greedy(model_dir, chat_ids(tok, CHAT), MAX_NEW)
        chunks = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                stream=True)
        assert [t for ch in chunks for c in ch.choices for t in c.token_ids] == want
        with Client(served.zmq, timeout_s=60) as zc:
            done = zc.generate(PROMPTS[2], max_tokens=MAX_NEW, temperature=0, return_timeline=True)
        assert done.token_ids == hf_greedy(model_dir, tok.encode(PROMPTS[2]), MAX_NEW)
        assert list(done.timeline) == COLOCATED_TIMELINE
        times = list(done.timeline.values())
        assert times == sorted(times)
    except BaseException:
        with contextlib.suppress(Exception):  # still stop it when the test fails; report the first failure
            stop_server(served, signal.SIGTERM)
        raise
    stop_server(served, signal.SIGINT)
    check_ready_file_workers(served, {"colocated-0": "colocated", "colocated-1": "colocated"})
