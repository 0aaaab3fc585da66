"""Admission on the decode worker: requests wait in arrival order for blocks and batch
slots (a head that does not fit holds back the ones behind it), and blocks the worker's
own prefix cache already holds are not asked of the prefill worker."""
from __future__ import annotations

from pdserve.decode_node.requests import State
from tests.support.decode_harness import NUM_BLOCKS, make_harness, nblocks, prompt


def test_fifo_admission_when_blocks_run_out(h):
    """Four 100-token prompts hold 28 of 32 blocks; the fifth waits, and a short prompt
    behind it that would fit does not jump it."""
    for i in range(4):
        h.generate(f"r{i}", prompt(100, 30 + i), max_tokens=2)
    h.generate("big", prompt(100, 40), max_tokens=2)
    h.generate("small", prompt(20, 41), max_tokens=2)
    h.worker.try_reserve()
    assert [h.state(f"r{i}") for i in range(4)] == [State.RESERVED] * 4
    assert h.state("big") == State.PENDING and h.state("small") == State.PENDING
    assert h.free == NUM_BLOCKS - 4 * 7 == 4  # room for "small" (2 blocks), not for "big" (7)
    for _ in range(3):
        h.turn()
        assert h.state("small") == State.PENDING
    h.prefill_failed("r0")  # frees 7 blocks: "big" first, then "small"
    h.worker.try_reserve()
    assert h.state("big") == State.RESERVED and h.state("small") == State.RESERVED
    assert [m.request_id for m in h.client.prefill_requests()] == ["r0", "r1", "r2", "r3", "big", "small"]
    for rid in ("r1", "r2", "r3", "big", "small"):
        h.kv_ready(rid)
    h.run_until_idle()
    for rid in ("r1", "r2", "r3", "big", "small"):
        assert h.terminal(rid).finish_reason == "length"


def test_fifo_admission_when_seq_slots_run_out(decode_config):
    import dataclasses
    config = dataclasses.replace(decode_config,
                                 scheduler=dataclasses.replace(decode_config.scheduler, max_num_seqs=2))
    h = make_harness(config, "d1")
    try:
        h.generate("a", prompt(20, 50), max_tokens=3)
        h.generate("b", prompt(20, 51), max_tokens=3)
        h.generate("loc", prompt(20, 52), max_tokens=3, local=True)  # queued in the engine
        h.generate("c", prompt(20, 53), max_tokens=3)
        h.worker.try_reserve()
        assert h.state("a") == h.state("b") == State.RESERVED and h.state("c") == State.PENDING
        h.turn()  # the local prompt does not get a slot either: two are reserved
        assert len(h.worker.engine.scheduler.waiting) == 1 and h.tokens("loc") == []
        h.kv_ready("a")
        h.kv_ready("b")
        h.run_until_idle()
        h.worker.try_reserve()
        assert h.state("c") == State.RESERVED
        h.kv_ready("c")
        h.run_until_idle()
        h.check_clean()
    finally:
        h.worker.close()


def test_prefix_cached_blocks_are_skipped(h):
    base = prompt(48, 60)
    h.generate("a", base + prompt(10, 61), max_tokens=2)
    h.worker.try_reserve()
    h.kv_ready("a")
    h.run_until_idle()
    h.generate("b", base + prompt(20, 62), max_tokens=2)
    h.worker.try_reserve()
    pr = h.prefill_request("b")
    assert pr.skip_blocks == 3 and len(pr.dst_block_ids) == nblocks(68) - 3
    assert h.req("b").seq.block_table[3:] == pr.dst_block_ids
    assert h.worker.counters["blocks_reused"] == 3
    h.kv_ready("b")
    h.run_until_idle()
