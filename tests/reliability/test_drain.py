"""SIGTERM to a decode worker drains it: the streams it is serving finish there, token for
token as in the uninterrupted run (no resume elsewhere was needed), new requests go to the
other decode worker, and the drained worker exits within its drain time."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

from tests.support.reliability_harness import complete, recoveries, serve, stop, wait_blocks_baseline, wait_gone

MAX_NEW = 48
DRAIN_S = 3.0  # harness.FAST's --drain
# 40 ms per step on decode-0: its streams last ~2 s, so they are still running when SIGTERM
# comes at 1 s (the tiny model alone decodes 48 tokens in ~0.2 s), and end within DRAIN_S
SLOW_DECODE = "delay_step_ms=40@decode-0"


def test_sigterm_drains_a_decode_worker(tmp_path, prompts, greedy):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2", "--routing", "round_robin"], faults=SLOW_DECODE)
    try:
        pid = served.info["workers"]["decode-0"]["pid"]
        some = prompts[:4]
        with concurrent.futures.ThreadPoolExecutor(len(some)) as pool:
            running = [pool.submit(lambda p: (complete(served, p, MAX_NEW), time.monotonic()), p) for p in some]
            time.sleep(1.0)  # round robin: two of them are on decode-0 by now
            os.kill(pid, signal.SIGTERM)
            killed_at = time.monotonic()
            later = pool.submit(complete, served, prompts[4], 8)  # arrives while decode-0 drains
            results, ended = zip(*[f.result() for f in running])
            late = later.result()
        assert max(ended) > killed_at, "every stream ended before SIGTERM: the drain was not tested"
        for ids, res in zip(some, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert late["error"] is None and late["token_ids"] == greedy(prompts[4], 8)
        assert recoveries(served).get("resume", 0) == 0, "a stream was cut and resumed instead of drained"
        wait_gone([pid], DRAIN_S + 10)
        wait_blocks_baseline(served, ["prefill-0", "decode-1"])
    finally:
        stop(served)
