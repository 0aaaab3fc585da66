"""The fault-tolerance tests run real `pdserve serve` deployments of the tiny model, each
with its own faults; every test stops its deployment and checks no process outlives it."""
from __future__ import annotations

import pytest

from pdserve.common.text.tokenizer import Tokenizer
from tests.support.helpers import one_torch_thread
from tests.support.reliability_harness import MODEL



@pytest.fixture(scope="package", autouse=True)
def model_dir(model_dirs) -> str:
    MODEL["dir"] = model_dirs["qwen3"]
    return model_dirs["qwen3"]


@pytest.fixture(scope="package")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="package")
def greedy(model_dir, hf_greedy):
    """greedy(prompt_ids, n) -> transformers' greedy continuation (the uninterrupted run)."""
    cache: dict = {}

    def run(ids: list[int], n: int) -> list[int]:
        key = (tuple(ids), n)
        if key not in cache:
            with one_torch_thread():
                cache[key] = list(hf_greedy(model_dir, ids, n))
        return cache[key]
    return run


@pytest.fixture(scope="package")
def prompts(tok) -> list[list[int]]:
    texts = ["The router sends each request to", "Hello, my name is", "A prefill worker computes the prompt",
             "Decode workers stream tokens", "Every failure ends in a defined state", "Leases free blocks",
             "Nothing is lost and nothing leaked", "Workers exit when their router is gone"]
    return [tok.encode(t) for t in texts]
