"""SIGTERM to a decode worker drains it: the streams it is serving finish there, token for
token as in the uninterrupted run (no resume elsewhere was needed), new requests go to the
other decode worker, and the drained worker exits within its drain time."""
from __future__ import annotations

import concurrent.futures
import os
import signal
import time

from tests.reliability.harness import complete, recoveries, serve, stop, wait_blocks_baseline, wait_gone

MAX_NEW = 48  # long enough that the streams are still running when SIGTERM comes
DRAIN_S = 3.0  # harness.FAST's --drain


def test_sigterm_drains_a_decode_worker(tmp_path, prompts, greedy):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "2", "--routing", "round_robin"])
    try:
        pid = served.info["workers"]["decode-0"]["pid"]
        some = prompts[:4]
        with concurrent.futures.ThreadPoolExecutor(len(some)) as pool:
            running = [pool.submit(complete, served, p, MAX_NEW) for p in some]
            time.sleep(1.0)  # round robin: two of them are on decode-0 by now
            os.kill(pid, signal.SIGTERM)
            later = pool.submit(complete, served, prompts[4], 8)  # arrives while decode-0 drains
            results = [f.result() for f in running]
            late = later.result()
        for ids, res in zip(some, results):
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert late["error"] is None and late["token_ids"] == greedy(prompts[4], 8)
        assert recoveries(served).get("resume", 0) == 0, "a stream was cut and resumed instead of drained"
        wait_gone([pid], DRAIN_S + 10)
        wait_blocks_baseline(served, ["prefill-0", "decode-1"])
    finally:
        stop(served)
