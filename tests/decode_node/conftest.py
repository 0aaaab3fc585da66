"""Fixtures of the decode worker's in-process tests (the fakes live in harness.py)."""
from __future__ import annotations

import pytest

from pdserve.common.config import EngineConfig
from tests.support.decode_harness import BLOCK, MAX_LEN, NUM_BLOCKS, make_harness


@pytest.fixture(scope="module")
def decode_config(model_dirs) -> EngineConfig:
    return EngineConfig.build(model_dirs["qwen3"], block_size=BLOCK, num_kv_blocks=NUM_BLOCKS,
                              max_model_len=MAX_LEN, max_num_seqs=8, max_num_batched_tokens=64, num_threads=1)


@pytest.fixture
def h(decode_config):
    harness = make_harness(decode_config)
    assert harness.baseline == NUM_BLOCKS
    try:
        yield harness
        harness.check_clean()
    finally:
        harness.worker.close()
