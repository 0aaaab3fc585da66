"""Log-probabilities from the offline engine equal transformers' log_softmax of the
same logits (float32 within 8x transformers' own float32 error of float64) (vLLM's raw_logprobs: before penalties and temperature), and asking for
them changes no token of any request in the batch."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.sampling_params import SamplingParamsError
from tests.support.helpers import mixed_prompts
from tests.support.numerics import LogprobReference, logprob_reference

MAX_NEW = 6


def _hf_logprobs(model_dir: str, ids: list[int]) -> LogprobReference:
    """transformers' log_softmax in float64 [S, V], with the float32 tolerance `tol`
    (tests/support/numerics.py): at most 8x transformers' own float32 error."""
    return logprob_reference(model_dir)(ids)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_logprobs_equal_transformers_float32_log_softmax(arch, model_dirs):
    model_dir = model_dirs[arch]
    llm = LLM(model_dir, num_kv_blocks=128, max_model_len=256, dtype="float32")
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=3)[:4]
    # greedy with 5 top; sampled with penalties: raw logprobs ignore temperature and penalties
    params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=5),
              SamplingParams(temperature=0.8, seed=1, max_tokens=MAX_NEW, logprobs=20, repetition_penalty=1.5,
                             presence_penalty=1.0),
              SamplingParams(temperature=0, max_tokens=MAX_NEW, logprobs=0),
              SamplingParams(temperature=0, max_tokens=MAX_NEW)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert "logprobs" not in outs[3]
    for p, sp, o in zip(prompts, params[:3], outs[:3]):
        assert len(o["logprobs"]) == len(o["token_ids"])
        ref = _hf_logprobs(model_dir, p + o["token_ids"])  # row t predicts token t+1
        for k, (tok, lp) in enumerate(zip(o["token_ids"], o["logprobs"])):
            row = ref[len(p) - 1 + k]
            assert lp.logprob == pytest.approx(row[tok].item(), abs=ref.tol)
            want_vals, want_ids = row.topk(sp.logprobs)
            assert len(lp.top_ids) == sp.logprobs
            assert lp.top_logprobs == pytest.approx(want_vals.tolist(), abs=ref.tol)
            assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
            assert set(lp.top_ids) == set(want_ids.tolist()) or sp.logprobs == 0  # ties could reorder ids
            if sp.greedy and sp.logprobs:
                assert lp.top_ids[0] == tok and lp.top_logprobs[0] == lp.logprob


def test_asking_for_logprobs_changes_no_token(model_dirs):
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=256)
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=5)[:6]
    plain = [SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_NEW) for i in range(6)]
    alone = llm.generate(prompts, plain, use_tqdm=False)
    mixed = [SamplingParams(temperature=0.7, seed=i, max_tokens=MAX_NEW, logprobs=3) if i % 2 else plain[i]
             for i in range(6)]
    together = llm.generate(prompts, mixed, use_tqdm=False)
    assert [o["token_ids"] for o in together] == [o["token_ids"] for o in alone]
    assert all(("logprobs" in o) == bool(i % 2) for i, o in enumerate(together))


@pytest.mark.parametrize("bad", [-1, 21])
def test_logprobs_out_of_range_is_refused(bad):
    with pytest.raises(SamplingParamsError, match="logprobs"):
        SamplingParams(logprobs=bad)
