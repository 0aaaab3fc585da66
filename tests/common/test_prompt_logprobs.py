"""Prompt log-probabilities from the offline engine (SamplingParams.prompt_logprobs, vLLM's)
equal transformers' log_softmax of the same logits within float32's reach of its float64 value: every prompt position is
computed even when the prefix cache holds it, chunk by chunk when the prompt is longer
than a step; max_tokens 0 scores the prompt and samples nothing, holding no block after."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.sampling_params import SamplingParamsError
from tests.support.helpers import mixed_prompts
from tests.support.numerics import LogprobReference, logprob_reference

K = 5


def _hf_logprobs(model_dir: str, ids: list[int]) -> LogprobReference:
    """transformers' log_softmax in float64 [S, V], with the float32 tolerance `tol`
    (tests/support/numerics.py): at most 8x transformers' own float32 error."""
    return logprob_reference(model_dir)(ids)


def check_prompt_logprobs(model_dir: str, prompt: list[int], got: list, k: int) -> None:
    """`got` (a TokenLogprobs per prompt token, the first None) against transformers."""
    ref = _hf_logprobs(model_dir, prompt)  # row t predicts token t + 1
    assert len(got) == len(prompt) and got[0] is None
    for j in range(1, len(prompt)):
        lp, row = got[j], ref[j - 1]
        assert lp.logprob == pytest.approx(row[prompt[j]].item(), abs=ref.tol), j
        assert lp.rank == int((row > row[prompt[j]]).sum()) + 1 or abs(lp.logprob - row[prompt[j]].item()) < ref.tol
        want_vals, want_ids = row.topk(k)
        assert lp.top_logprobs == pytest.approx(want_vals.tolist(), abs=ref.tol)
        assert len(lp.top_ids) == k and (set(lp.top_ids) == set(want_ids.tolist()) or k == 0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_prompt_logprobs_equal_transformers(arch, model_dirs):
    model_dir = model_dirs[arch]
    # a step of 16 tokens: the 40-token prompt is computed in three chunks
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256, dtype="float32", max_num_batched_tokens=16,
              block_size=8)
    vocab = llm.engine.config.model.vocab_size
    prompt = mixed_prompts(vocab, seed=7)[0][:10] * 4
    prompt = prompt[:40]
    params = SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K)
    first = llm.generate(prompt, params, use_tqdm=False)[0]
    check_prompt_logprobs(model_dir, prompt, first["prompt_logprobs"], K)
    # the same prompt again: its blocks are cached, yet every position is computed
    again = llm.generate(prompt, params, use_tqdm=False)[0]
    assert again["num_cached_tokens"] == 0
    assert [lp and lp.logprob for lp in again["prompt_logprobs"]] == \
        pytest.approx([lp and lp.logprob for lp in first["prompt_logprobs"]], abs=1e-5)
    plain = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert "prompt_logprobs" not in plain and plain["token_ids"] == first["token_ids"]


def test_max_tokens_zero_scores_the_prompt(model_dirs):
    model_dir = model_dirs["qwen3"]
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=128, dtype="float32")
    bm = llm.engine.block_manager
    free = bm.num_free_blocks
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=2)[:3]
    params = [SamplingParams(temperature=0, max_tokens=0, prompt_logprobs=0),
              SamplingParams(temperature=0, max_tokens=4),
              SamplingParams(temperature=0.5, seed=3, max_tokens=0, prompt_logprobs=2, logprobs=1)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for o, p, sp in zip(outs, prompts, params):
        if sp.max_tokens == 0:
            assert o["token_ids"] == [] and o["finish_reason"] == "length" and o["text"] == ""
            check_prompt_logprobs(model_dir, p, o["prompt_logprobs"], sp.prompt_logprobs)
    alone = llm.generate(prompts[1], params[1], use_tqdm=False)[0]
    assert outs[1]["token_ids"] == alone["token_ids"] and len(alone["token_ids"]) == 4  # the plain one, untouched
    assert not llm.engine.has_work() and not llm.engine.scheduler.running
    assert bm.num_free_blocks == free
    bm.check_invariants()


@pytest.mark.parametrize("bad,field", [(dict(prompt_logprobs=-1), "prompt_logprobs"),
                                       (dict(prompt_logprobs=21), "prompt_logprobs"),
                                       (dict(max_tokens=0), "max_tokens")])
def test_bad_prompt_logprobs_values_are_refused(bad, field):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**bad)


def test_one_token_prompt_chunks_through_the_graph_runner(model_dirs):
    """A 2-token step beside a decoding request leaves the prompt 1-token chunks: a batch of
    single rows, which the graph runner would run as a decode step without prompt rows."""
    model_dir = model_dirs["qwen3"]
    llm = LLM(model_dir, num_kv_blocks=64, max_model_len=128, dtype="float32", decode_graphs=True,
              max_num_batched_tokens=2)
    a, b = mixed_prompts(llm.engine.config.model.vocab_size, seed=4)[:2]
    outs = llm.generate([a[:3], b[:8]], [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)],
                        use_tqdm=False)
    check_prompt_logprobs(model_dir, b[:8], outs[1]["prompt_logprobs"], 1)
