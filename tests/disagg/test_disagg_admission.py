"""A decode worker too small to hold every request at once: requests wait for blocks
(admission control) and running ones may be preempted and recomputed on D, yet every
request completes with the exact greedy output and no block is lost."""
from __future__ import annotations

import random

import pytest

from tests.support.disagg_driver import engine_options, num_blocks, shm_segments, start_pair

MAX_NEW = 16
D_BLOCKS = 40


@pytest.mark.parametrize("backend", ["shm", "gloo"])
def test_small_decode_worker_serves_everything(backend, model_dirs, vocab_size, hf_greedy, tmp_path):
    model_dir = model_dirs["qwen3"]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, vocab_size) for _ in range(92 + i)] for i in range(16)]
    # 16 prompts of 92..107 tokens need 6-7 blocks each on arrival and 7-8 when done:
    # D's 40 blocks hold about five at a time
    assert sum(num_blocks(p) for p in prompts) > 2 * D_BLOCKS

    dep = start_pair(model_dir, backend, engine_options(num_kv_blocks=256, max_model_len=512),
                     decode_options={"num_kv_blocks": D_BLOCKS, "max_model_len": 256},
                     workdir=tmp_path, together=True)
    try:
        result = dep.run(prompts, MAX_NEW, timeout_s=120)
        assert not result.errors, f"{result.errors}\n{dep.logs()}"
        for i, (prompt, got) in enumerate(zip(prompts, result.outputs())):
            assert got == hf_greedy(model_dir, prompt, MAX_NEW), f"prompt {i}"
        d, p = result.decode_status, result.prefill_status
        assert d.total_blocks == D_BLOCKS
        assert d.free_blocks == d.total_blocks, d
        assert p.free_blocks == p.total_blocks, p
        assert d.counters["finished"] == len(prompts) and d.counters["failed"] == 0
    finally:
        dep.close()
    assert dep.decode.proc.returncode is not None
    assert not shm_segments(dep.decode), "the decode worker's shm KV cache outlived it"
