"""Fixtures for the multi-process disaggregation tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def torch_one_thread_here():
    """The transformers oracle runs in this process next to two single-threaded workers
    on a 2-core machine; a second torch thread makes it >10x slower through contention."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="session")
def vocab_size(model_dirs) -> int:
    from common.config import ModelConfig
    sizes = {ModelConfig.from_dir(d).vocab_size for d in model_dirs.values()}
    assert len(sizes) == 1, f"the tiny models disagree on vocab size: {sizes}"
    return sizes.pop()
