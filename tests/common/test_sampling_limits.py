"""The edge limits on sampling values (common/sampling_params.py) and the sampler's
guarantees they rely on: values that once crashed a worker are refused or sampled safely."""
from __future__ import annotations

import pytest
import torch

from pdserve.common.engine.sampler import Sampler
from pdserve.common.sampling_params import MAX_TOKENS_LIMIT, MAX_TOP_K, SamplingParams, SamplingParamsError


@pytest.mark.parametrize("values", [
    {"top_k": 2**63}, {"top_k": MAX_TOP_K + 1}, {"max_tokens": 2**64}, {"max_tokens": MAX_TOKENS_LIMIT + 1},
    {"temperature": float("inf")}, {"temperature": float("nan")}, {"temperature": 1e9}, {"top_p": 0.0},
    {"stop": ["\ud800"]}, {"stop": ["x"] * 17}, {"stop": ["x" * 1025]}, {"seed": 2**63},
], ids=str)
def test_out_of_range_is_refused(values):
    with pytest.raises(SamplingParamsError, match=next(iter(values))):
        SamplingParams(**values)


def test_tiny_temperature_is_greedy_and_tiny_top_p_keeps_the_top_token():
    logits = torch.randn(4, 97, generator=torch.Generator().manual_seed(0))  # [B, V]
    params = [SamplingParams(temperature=1e-300), SamplingParams(temperature=1.0, top_p=1e-300),
              SamplingParams(temperature=0.7, top_k=MAX_TOP_K, top_p=1e-300),
              SamplingParams(temperature=1.0, top_k=1)]
    assert params[0].greedy and not SamplingParams(temperature=1e-5).greedy
    assert Sampler()(logits, params, [None] * 4) == logits.argmax(-1).tolist()
