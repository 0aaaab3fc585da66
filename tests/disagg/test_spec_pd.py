"""Speculative decoding across the split: the prefill worker samples each first token (it
never speculates), the decode worker speculates from there on, its draft (the model's int8
copy) reading the prompt's KV as the prefill worker wrote it into the shared cache. Greedy
output equals transformers', with features that shape the logits too; each output entry
carries its verifications' counts, the timeline the request's, the worker's status the
totals."""
from __future__ import annotations

import json

import pytest

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import GenerateRequest
from tests.support.disagg_driver import engine_options, start_pair
from tests.support.helpers import mixed_prompts

MAX_NEW = 16
OPTIONS = engine_options(num_kv_blocks=256, max_model_len=512)
SPEC = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3,
        "adaptive": False}


@pytest.fixture(scope="module")
def pair(model_dirs, tmp_path_factory):
    # the same options everywhere: the prefill worker is given speculative_config too and ignores it
    options = {**OPTIONS, "speculative_config": json.dumps(SPEC)}
    dep = start_pair(model_dirs["qwen3"], "shm", options, prefill_options={"max_num_batched_tokens": 64},
                     workdir=tmp_path_factory.mktemp("spec"), together=True)
    yield dep
    dep.close()


def test_greedy_matches_transformers_speculating_on_decode(pair, vocab_size, hf_greedy):
    prompts = mixed_prompts(vocab_size, seed=7)
    requests = [GenerateRequest(pair.new_id(), p, SamplingParams(temperature=0, max_tokens=MAX_NEW),
                                prefill_addr=pair.prefill_addr, return_timeline=True) for p in prompts]
    pair.send(requests)
    result = pair.collect([r.request_id for r in requests])
    assert not result.errors, f"{result.errors}\n{pair.logs()}"
    for i, (p, got) in enumerate(zip(prompts, result.outputs())):
        assert got == hf_greedy(pair.model_dir, p, MAX_NEW), f"prompt {i} (len {len(p)})"
    d, p = result.decode_status.counters, result.prefill_status.counters
    assert 0 < d["spec_accepted_tokens"] < d["spec_draft_tokens"], d
    assert "spec_draft_tokens" not in p, "the prefill worker speculated"
    timelines = [result.finals[r.request_id].timeline for r in requests]
    drafted = sum(t.get("spec_draft_tokens", 0) for t in timelines)
    assert drafted == d["spec_draft_tokens"] and all(t["spec_accepted_tokens"] <= t["spec_draft_tokens"]
                                                      for t in timelines if "spec_draft_tokens" in t)
    bm_free = result.decode_status.free_blocks
    assert bm_free == result.decode_status.total_blocks


def test_logits_features_across_the_split(pair, vocab_size, model_dirs):
    """Penalties and bias shape each verified row over its own history on D; the output is
    the offline engine's without speculation."""
    from pdserve.common import LLM
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)
    prompts = mixed_prompts(vocab_size, seed=5)[1:7]
    features = [{"repetition_penalty": 1.6}, {"presence_penalty": 1.2, "frequency_penalty": 0.6},
                {"logit_bias": ((7, 6.0), (9, -100.0))}, {"min_tokens": 6, "stop_token_ids": [13],
                                                          "logit_bias": ((13, 40.0),)},
                {"repetition_penalty": 0.3}, {}]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, **f) for f in features]
    want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    requests = [GenerateRequest(pair.new_id(), p, sp, prefill_addr=pair.prefill_addr) for p, sp in zip(prompts, params)]
    pair.send(requests)
    result = pair.collect([r.request_id for r in requests])
    assert not result.errors, f"{result.errors}\n{pair.logs()}"
    assert result.outputs() == want
