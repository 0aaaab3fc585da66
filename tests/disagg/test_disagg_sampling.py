"""The logits features across the split: a prefill worker samples each first token, the
decode worker the rest, both with the request's SamplingParams and the token history D
holds (prompt and output). One mixed batch of penalised, biased, min_tokens-held and plain
requests, greedy and seeded, equals the offline engine token for token."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.disagg_driver import engine_options, start_pair
from tests.support.helpers import mixed_prompts

MAX_NEW = 12
OPTIONS = engine_options(num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    dep = start_pair(model_dirs["qwen3"], "shm", OPTIONS, prefill_options={"max_num_batched_tokens": 64},
                     workdir=tmp_path_factory.mktemp("sampling"), together=True)
    yield dep
    dep.close()


def test_mixed_features_through_prefill_and_decode_equal_offline(pair, model_dirs, vocab_size):
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=512)
    eos = min(llm.engine.eos_token_ids)
    prompts = mixed_prompts(vocab_size, seed=5)[1:9]
    features: list[dict] = [
        {},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 0.8},
        {"logit_bias": ((7, 6.0), (9, -100.0))},
        {"min_tokens": 4, "ignore_eos": False, "logit_bias": ((eos, 40.0),)},  # P's first token must not be EOS
        {"min_tokens": 2, "stop_token_ids": [13], "logit_bias": ((13, 40.0),)},
        {"temperature": 1.2, "min_p": 0.1, "seed": -9, "repetition_penalty": 1.3},
        {},
    ]
    base = {"temperature": 0.0, "max_tokens": MAX_NEW, "ignore_eos": True}
    params = [SamplingParams(**{**base, **f}) for f in features]
    want = llm.generate(prompts, params, use_tqdm=False)
    requests = [pair.request(p, **{**base, **f}) for p, f in zip(prompts, features)]
    pair.send(requests)
    result = pair.collect([r.request_id for r in requests])
    assert not result.errors, f"{result.errors}\n{pair.logs()}"
    got = result.outputs()
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w["token_ids"], f"request {i} {features[i]}: P/D {g} != offline {w['token_ids']}"
    assert len(got[4]) == 5 and got[4][-1] == eos, "min_tokens held EOS off for 4 tokens, on P and on D"
    assert len(got[5]) == 3 and got[5][-1] == 13 and 13 not in got[5][:2], "a stop token id, once min_tokens allow it"
    assert [result.finals[r.request_id].finish_reason for r in requests[4:6]] == ["stop", "stop"]
