"""Speculative decoding on the default model (SmolLM2-135M-Instruct) at float32: greedy
output with its own int4 copy drafting, and with prompt lookup, is transformers' token
for token (chat prompts, one of them asking to repeat its text, where lookup pays), and
the int4 copy's drafts are mostly accepted."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_NEW = 40
QUESTIONS = ["Repeat this sentence exactly: the quick brown fox jumps over the lazy dog near the river bank.",
             "What is the capital of France?", "Write a haiku about the sea."]
SPECS = {
    "self_int4": {"method": "draft_model", "model": "self", "quantization": "int4", "num_speculative_tokens": 4,
                  "adaptive": False},
    "ngram": {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
              "adaptive": False},
}


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_matches_transformers(real_model_dir, hf_greedy, name):
    llm = LLM(real_model_dir, dtype="float32", quantization="none", num_kv_blocks=64, max_model_len=256,
              speculative_config=SPECS[name])
    tok = llm.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(real_model_dir, ids, MAX_NEW)
    stats = llm.engine.speculator.stats
    if name == "self_int4":
        assert stats.num_accepted_tokens >= 0.6 * stats.num_draft_tokens > 0, stats
    else:
        assert stats.num_accepted_tokens >= 10, stats  # the repeated sentence
