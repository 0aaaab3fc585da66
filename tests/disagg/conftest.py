"""Fixtures for the multi-process disaggregation tests."""
from __future__ import annotations

import pytest

from tests.support.helpers import one_torch_thread


@pytest.fixture(autouse=True, scope="module")
def torch_one_thread_here():
    """The transformers oracle runs in this process next to two single-threaded workers."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="session")
def vocab_size(model_dirs) -> int:
    from pdserve.common.config import ModelConfig
    sizes = {ModelConfig.from_dir(d).vocab_size for d in model_dirs.values()}
    assert len(sizes) == 1, f"the tiny models disagree on vocab size: {sizes}"
    return sizes.pop()
