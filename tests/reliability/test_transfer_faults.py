"""Lost, corrupt and late KV transfers, injected on one prefill worker: the request is
re-prefilled every time (on its decode worker: never again on the prefill worker that
failed it), never decoded from bad KV, and ends with the uninterrupted greedy output; a prefill worker whose loop is stuck for twice the liveness timeouts is
not taken for dead (liveness is answered off the step loop)."""
from __future__ import annotations

from tests.support.reliability_harness import (complete, counters, health, recoveries, serve, stop,
                                               wait_blocks_baseline)

MAX_NEW = 12


def test_drop_corrupt_delay_then_complete(tmp_path, prompts, greedy):
    # transfer 1 is dropped (the lease of 2 s expires), transfer 2 is corrupt (its checksum
    # fails), transfer 3 arrives 3 s late: the lease expires first, and D holds the blocks
    # until that KVReady fences P; transfer 4 is fine. A retry never returns to the prefill
    # worker that failed it: with no other, each of the first three requests is prefilled
    # again on its decode worker (docs/reliability.md, "Degraded modes"); the fourth goes via
    # P again. Liveness timeouts: 1 s.
    faults = "drop_transfer=1,corrupt_transfer=2,delay_transfer_ms=3000,delay_transfer_at=3"
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"], faults=faults,
                   extra=("--lease", "2", "--verify-transfers", "--retries", "5", "--stale-after", "1",
                          "--peer-timeout", "1"))
    try:
        for ids in prompts[:3]:
            res = complete(served, ids, MAX_NEW)
            assert res["error"] is None, res
            assert res["token_ids"] == greedy(ids, MAX_NEW)
        assert recoveries(served).get("reprefill", 0) == 3
        assert counters(served, "pdserve_degraded_requests_total") == {"no_prefill": 3.0}
        h = health(served)
        assert h["dead"] == [] and h["status"] == "ok", f"a slow prefill worker was taken for dead: {h}"
        wait_blocks_baseline(served, ["prefill-0", "decode-0"])
        res = complete(served, prompts[3], MAX_NEW)  # the faults are spent: a plain request, via P
        assert res["error"] is None and res["token_ids"] == greedy(prompts[3], MAX_NEW)
        assert recoveries(served).get("reprefill", 0) == 3
        assert counters(served, "pdserve_degraded_requests_total") == {"no_prefill": 3.0}
    finally:
        stop(served)


def test_retries_exhausted_is_a_clear_error(tmp_path, prompts):
    """Every transfer of a request is dropped past its retries: a clear error, nothing leaked."""
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"], faults="drop_transfer=1",
                   extra=("--lease", "1", "--retries", "0"))
    try:
        res = complete(served, prompts[2], MAX_NEW)
        assert res["token_ids"] == [] and res["error"] is not None
        assert "did not land" in res["error"]["message"], res
        wait_blocks_baseline(served, ["prefill-0", "decode-0"])
    finally:
        stop(served)
