"""No request fails while any worker could serve it (docs/reliability.md, "Degraded modes"),
with real processes:

- 1P+1D, the prefill worker kill -9'd while 12 streamed requests with long prompts are in
  flight, then 8 new requests at once: all 20 complete with the text of the same
  deployment's run before the loss (equal to transformers, float32) -- re-routed to their
  decode worker, which prefills them itself -- no client sees an error, /health says
  degraded, the counter counts them, every decode block is free within 5 s; a prefill
  worker added afterwards takes the prompts again by itself.
- The decode pool empty: a request waits --worker-wait, then gets 503 + Retry-After (a
  stream too, before any 200); a decode worker added, the deployment serves again."""
from __future__ import annotations

import json
import random
import time
import urllib.error
import urllib.request

from tests.support.reliability_harness import (Streams, complete, counters, health, kill_worker, recoveries, scale,
                                               serve, stop, wait_blocks_baseline)

MAX_NEW = 16
IN_FLIGHT, BURST = 12, 8
BLOCKS_FREE_WITHIN_S = 5.0
# the prefill worker's steps are slowed so that the 12 prompts are still on it when it dies
# (a step of the tiny model takes milliseconds); its token budget spreads them over steps
SLOW_PREFILL = "delay_step_ms=300@prefill-0"


def long_prompts(vocab: int, n: int) -> list[list[int]]:
    rng = random.Random(53)
    return [[rng.randrange(3, vocab) for _ in range(100 + 5 * i)] for i in range(n)]  # 100..195 tokens


def test_prefill_worker_killed_under_long_prompts_then_a_burst(tmp_path, tok, greedy):
    prompts = long_prompts(tok.vocab_size, IN_FLIGHT + BURST)
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1", "--no-prefix-caching", "--max-num-batched-tokens", "400"],
                   faults=SLOW_PREFILL, extra=("--lease", "30"))  # after the harness's --lease 3: the slow P trips none
    try:
        before = Streams(served.http, prompts).join()  # the same deployment's run before the loss
        for ids, res in zip(prompts, before):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert counters(served, "pdserve_degraded_requests_total") == {}

        in_flight = Streams(served.http, prompts[:IN_FLIGHT])
        assert in_flight.first.wait(60), "no stream started"
        kill_worker(served, "prefill-0")  # kill -9, most of the 12 prompts still on it
        burst = Streams(served.http, prompts[IN_FLIGHT:])  # right after, all at once
        after = in_flight.join() + burst.join()
        done = time.monotonic()
        errors = [(i, r["error"]) for i, r in enumerate(after) if r["error"] is not None]
        assert not errors, f"clients saw errors: {errors}\n{served.log_tail()}"
        assert [r["token_ids"] for r in after] == [r["token_ids"] for r in before]
        wait_blocks_baseline(served, ["decode-0"], timeout=BLOCKS_FREE_WITHIN_S)
        print(f"decode blocks free {time.monotonic() - done:.2f} s after the last request ended")

        assert recoveries(served).get("reprefill", 0) >= 1, "no request was in flight on the prefill worker"
        degraded = counters(served, "pdserve_degraded_requests_total")
        assert degraded.get("no_prefill", 0) >= BURST, degraded  # the burst at least went to D's own prefill
        h = health(served)
        assert h["status"] == "degraded" and h["dead"] == ["prefill-0"] and "degraded" in h, h
        assert counters(served, "pdserve_degraded") == {"": 1.0}

        # a prefill worker is back: the prompts go to it again, nobody tells the router to
        pools = {w["worker_id"]: w for w in scale(served, "--prefill", "+1")}
        (new,) = [w for w, v in pools.items() if v["role"] == "prefill" and v["state"] == "serving"]
        assert health(served)["status"] == "ok"
        again = Streams(served.http, prompts[:4]).join()
        assert [r["token_ids"] for r in again] == [r["token_ids"] for r in before[:4]], again
        assert health(served)["pools"][new]["routed"] >= 4
        assert counters(served, "pdserve_degraded_requests_total")["no_prefill"] == degraded["no_prefill"]
        assert counters(served, "pdserve_degraded") == {"": 0.0}
        wait_blocks_baseline(served, ["decode-0", new])
    finally:
        stop(served)


def _post(served, stream: bool) -> tuple[int, dict, dict]:
    """(status, headers by lower-case name, body) of one completion over HTTP."""
    body = json.dumps({"prompt": [5, 6, 7, 8], "max_tokens": 4, "temperature": 0, "stream": stream}).encode()
    req = urllib.request.Request(served.http + "/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, {"raw": r.read().decode()}
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def test_empty_decode_pool_holds_then_503_with_retry_after_and_recovers_when_a_worker_joins(tmp_path, prompts,
                                                                                              greedy):
    wait_s = 2.0
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1", "--worker-wait", str(wait_s)])
    try:
        assert complete(served, prompts[0], MAX_NEW)["token_ids"] == greedy(prompts[0], MAX_NEW)
        kill_worker(served, "decode-0")
        deadline = time.monotonic() + 10
        while health(served)["status"] != "unavailable":
            assert time.monotonic() < deadline, health(served)
            time.sleep(0.1)
        for stream in (False, True):  # a stream too: a 503 before any 200, not an error event
            start = time.monotonic()
            status, headers, body = _post(served, stream)
            took = time.monotonic() - start
            assert status == 503 and headers.get("retry-after") == "1", (stream, status, headers, body)
            assert body["error"]["code"] == "unavailable", body
            assert wait_s - 0.2 <= took < wait_s + 5, f"refused after {took:.2f} s, the hold is {wait_s} s"
        assert counters(served, "pdserve_unavailable") == {"": 1.0}

        pools = {w["worker_id"]: w for w in scale(served, "--decode", "+1")}
        (new,) = [w for w, v in pools.items() if v["role"] == "decode" and v["state"] == "serving"]
        assert health(served)["status"] == "ok"
        for ids in prompts[:3]:
            res = complete(served, ids, MAX_NEW)
            assert res["error"] is None and res["token_ids"] == greedy(ids, MAX_NEW), res
        wait_blocks_baseline(served, ["prefill-0", new])
    finally:
        stop(served)
