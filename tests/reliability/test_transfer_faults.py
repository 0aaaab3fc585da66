"""Lost, corrupt and late KV transfers, injected on one prefill worker: the request is
re-prefilled every time, never decoded from bad KV, and ends with the uninterrupted
greedy output; a prefill worker whose loop is stuck for twice the liveness timeouts is
not taken for dead (liveness is answered off the step loop)."""
from __future__ import annotations

from tests.support.reliability_harness import complete, health, recoveries, serve, stop, wait_blocks_baseline

MAX_NEW = 12


def test_drop_corrupt_delay_then_complete(tmp_path, prompts, greedy):
    # transfer 1 is dropped (the lease of 2 s expires), transfer 2 is corrupt (its checksum
    # fails), transfer 3 arrives 3 s late: the lease expires first, and D holds the blocks
    # until that KVReady fences P; transfer 4 is fine (the retry queued behind the stuck P
    # may itself outlive its lease on a loaded machine: retries allow for one more).
    # Liveness timeouts: 1 s.
    faults = "drop_transfer=1,corrupt_transfer=2,delay_transfer_ms=3000,delay_transfer_at=3"
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"], faults=faults,
                   extra=("--lease", "2", "--verify-transfers", "--retries", "5", "--stale-after", "1",
                          "--peer-timeout", "1"))
    try:
        res = complete(served, prompts[0], MAX_NEW)
        assert res["error"] is None, res
        assert res["token_ids"] == greedy(prompts[0], MAX_NEW)
        assert recoveries(served).get("reprefill", 0) >= 3
        h = health(served)
        assert h["dead"] == [] and h["status"] == "ok", f"a slow prefill worker was taken for dead: {h}"
        wait_blocks_baseline(served, ["prefill-0", "decode-0"])
        res = complete(served, prompts[1], MAX_NEW)  # the faults are spent: a plain request
        assert res["error"] is None and res["token_ids"] == greedy(prompts[1], MAX_NEW)
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
