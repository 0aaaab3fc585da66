"""Greedy output of the offline engine equals transformers' generate, token for token."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.helpers import ARCHS
from tests.support.helpers import mixed_prompts

MAX_NEW = 24

# name -> engine options; each forces a different code path
SETTINGS = {
    "default": dict(num_kv_blocks=512, max_model_len=512),
    # 20 blocks of 16 tokens hold ~1.5 long sequences: the scheduler must preempt
    "preemption": dict(num_kv_blocks=20, max_model_len=256, max_num_seqs=16),
    # a 24-token budget chunks every prompt longer than 24 tokens
    "chunked": dict(num_kv_blocks=512, max_model_len=512, max_num_batched_tokens=24),
}


def _check(llm: LLM, model_dir: str, prompts: list[list[int]], hf_greedy) -> list[dict]:
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        want = hf_greedy(model_dir, p, MAX_NEW)
        assert o["token_ids"] == want, f"prompt {i} (len {len(p)}): ours {o['token_ids']} != hf {want}"
    return outs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_matches_transformers(arch, setting, model_dirs, hf_greedy):
    model_dir = model_dirs[arch]
    llm = LLM(model_dir, dtype="float32", **SETTINGS[setting])
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)
    first, second = prompts[:14], prompts[14:]
    _check(llm, model_dir, first, hf_greedy)
    # the second wave shares prefixes with each other and is sent after the first finished
    outs = _check(llm, model_dir, second, hf_greedy)
    outs += _check(llm, model_dir, [p + [5, 6, 7] for p in second[:2]], hf_greedy)
    if setting != "preemption":
        assert sum(o["num_cached_tokens"] for o in outs) >= 4 * 32, "prefix cache never hit"
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "tiny KV budget did not force preemption"
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked after all requests finished"


def test_text_prompts_match_transformers(model_dirs, hf_greedy):
    model_dir = model_dirs["qwen3"]
    llm = LLM(model_dir, dtype="float32", num_kv_blocks=128, max_model_len=256)
    prompts = ["The router sends each request to", "Hello, my name is", "A"]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for p, o in zip(prompts, outs):
        ids = llm.tokenizer.encode(p)
        assert o["prompt_token_ids"] == ids
        assert o["token_ids"] == hf_greedy(model_dir, ids, MAX_NEW)
        assert o["text"] == llm.tokenizer.decode(o["token_ids"])


def test_greedy_outputs_are_varied(model_dirs, hf_greedy):
    """The random init must not collapse into a repeated token (that would hide KV bugs)."""
    for arch in ARCHS:
        out = hf_greedy(model_dirs[arch], list(range(10, 40)), MAX_NEW)
        assert len(set(out)) >= MAX_NEW // 2, f"{arch}: greedy output too repetitive: {out}"
