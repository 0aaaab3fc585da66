"""The sampler's logits features (common/engine/sampler.py) against independent references:
greedy output with logit_bias / min_tokens / stop_token_ids / repetition_penalty equals
transformers' generate with the matching logits processors; presence and frequency
penalties equal a float64 computation by hand; min_p equals transformers' MinPLogitsWarper;
plain requests batched with penalised ones stay token-exact."""
from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.generation.logits_process import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                                                    MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor)

from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.sampler import Sampler, _filter_min_p, process_logits
from tests.support.helpers import mixed_prompts

MAX_NEW = 20


@pytest.fixture(scope="module")
def llm(model_dirs) -> LLM:
    return LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=512)


@pytest.fixture(scope="module")
def hf(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs["qwen3"], dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    return mixed_prompts(llm.engine.config.model.vocab_size, seed=11)[2:8]


def _hf_generate(hf, prompt: list[int], processors: list, eos: list[int], max_new: int = MAX_NEW) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                          max_new_tokens=max_new, do_sample=False, eos_token_id=eos, pad_token_id=eos[0],
                          logits_processor=LogitsProcessorList(processors))
    return out[0, len(prompt):].tolist()


def _eos(llm: LLM) -> list[int]:
    return sorted(llm.engine.eos_token_ids)


def test_repetition_penalty_matches_transformers(llm, hf, prompts):
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.8)
    plain = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert any(o["token_ids"] != p["token_ids"] for o, p in zip(outs, plain)), "the penalty changed nothing"
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == _hf_generate(hf, p, [RepetitionPenaltyLogitsProcessor(1.8)], _eos(llm))


def test_logit_bias_bans_like_transformers(llm, hf, prompts):
    """-100 on the tokens plain greedy would pick (bad words), +bias on another."""
    plain = llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]
    bias = {t: -100.0 for t in plain["token_ids"][:6]} | {7: 3.5}
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, logit_bias=bias), use_tqdm=False)
    assert not set(outs[0]["token_ids"]) & set(plain["token_ids"][:6])
    hf_bias = SequenceBiasLogitsProcessor(sequence_bias=[[[t], b] for t, b in bias.items()])
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == _hf_generate(hf, p, [hf_bias], _eos(llm))


@pytest.mark.parametrize("use_stop_ids", [False, True], ids=["eos", "stop_token_ids"])
def test_min_tokens_masks_stops_like_transformers(llm, hf, prompts, use_stop_ids):
    """A bias makes a stop token the greedy choice at once; min_tokens holds it off for
    exactly that many tokens, then it ends the request with "stop"."""
    stop_tok = 11 if use_stop_ids else _eos(llm)[0]
    stops = _eos(llm) + ([stop_tok] if use_stop_ids else [])
    common = dict(temperature=0, max_tokens=MAX_NEW, logit_bias={stop_tok: 30.0},
                  stop_token_ids=[stop_tok] if use_stop_ids else None)
    early = llm.generate(prompts[0], SamplingParams(**common), use_tqdm=False)[0]
    assert early["token_ids"] == [stop_tok] and early["finish_reason"] == "stop"
    outs = llm.generate(prompts, SamplingParams(**common, min_tokens=5), use_tqdm=False)
    for p, o in zip(prompts, outs):
        want = _hf_generate(hf, p, [SequenceBiasLogitsProcessor(sequence_bias=[[[stop_tok], 30.0]]),
                                    MinNewTokensLengthLogitsProcessor(len(p), 5, stops)], stops)
        assert o["token_ids"] == want and len(want) == 6 and want[-1] == stop_tok
        assert o["finish_reason"] == "stop"


def test_penalties_match_a_float64_reference(llm, hf, prompts):
    """Each greedy token equals the argmax of transformers' logits (float64) minus the
    OpenAI penalties computed by hand over the output so far."""
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, presence_penalty=1.5, frequency_penalty=0.7,
                            ignore_eos=True)
    outs = llm.generate(prompts[:3], params, use_tqdm=False)
    for p, o in zip(prompts, outs):
        seq = list(p)
        with torch.no_grad():
            logits = hf(torch.tensor([p + o["token_ids"]])).logits[0].double()  # [S, V]
        for k, tok in enumerate(o["token_ids"]):
            row = logits[len(p) + k - 1].clone()
            out_so_far = seq[len(p):]
            for t in set(out_so_far):
                row[t] -= 0.7 * out_so_far.count(t) + 1.5
            assert int(row.argmax()) == tok, f"step {k}"
            seq.append(tok)
    assert any(len(set(o["token_ids"])) == len(o["token_ids"]) for o in outs)


def test_process_logits_matches_hand_arithmetic():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0], [1.0, 1.0, 1.0, 1.0, 1.0],
                           [-1.0, 2.0, -3.0, 0.5, 1.0]])  # [B, V]
    params = [SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
              SamplingParams(), SamplingParams(repetition_penalty=4.0, presence_penalty=-1.0)]
    # row 0: prompt [0, 1], output [3, 3, 4]; row 2 (shorter: padded): prompt [2], output [2, 3]
    tokens = [[0, 1, 3, 3, 4], [0, 1, 2], [2, 2, 3]]
    out = process_logits(logits.clone(), params, tokens, [2, 1, 1], frozenset())
    want0 = [2.0 / 2, -1.0 * 2, 0.5, 3.0 / 2 - 2 * 0.5 - 0.25, -2.0 * 2 - 0.5 - 0.25]
    want2 = [-1.0, 2.0, -3.0 * 4 + 1.0, 0.5 / 4 + 1.0, 1.0]
    assert torch.allclose(out[0], torch.tensor(want0)) and torch.equal(out[1], logits[1])
    assert torch.allclose(out[2], torch.tensor(want2))


def test_min_p_matches_transformers_warper():
    logits = 3 * torch.randn(4, 97, generator=torch.Generator().manual_seed(0))
    for min_p in (0.05, 0.3, 1.0):
        ours = _filter_min_p(torch.softmax(logits, -1), [min_p] * 4)
        theirs = torch.softmax(MinPLogitsWarper(min_p)(None, logits.clone()), -1)
        assert torch.allclose(ours, theirs, atol=1e-6), min_p
    # sampled tokens always lie in the kept set
    params = [SamplingParams(temperature=1.0, min_p=0.3, seed=s) for s in range(4)]
    kept = _filter_min_p(torch.softmax(logits, -1), [0.3] * 4) > 0
    for _ in range(10):
        out = Sampler(seed=_)(logits, params, [None] * 4)
        assert all(kept[i, t] for i, t in enumerate(out))


def test_plain_requests_stay_exact_beside_penalised_ones(llm, prompts):
    plain_params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    alone = llm.generate(prompts, plain_params, use_tqdm=False)
    fancy = SamplingParams(temperature=0, max_tokens=MAX_NEW, repetition_penalty=1.5, frequency_penalty=1.0,
                           logit_bias={5: 50.0}, min_tokens=3)
    mixed = llm.generate(prompts + prompts, [plain_params] * len(prompts) + [fancy] * len(prompts), use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:len(prompts)]] == [o["token_ids"] for o in alone]
    assert all(o["token_ids"][0] == 5 for o in mixed[len(prompts):])


def test_top_k_zero_is_off_and_negative_seed_is_deterministic(llm, prompts):
    a = llm.generate(prompts[:2], SamplingParams(temperature=1.0, top_k=0, seed=-7, max_tokens=8), use_tqdm=False)
    b = llm.generate(prompts[:2], SamplingParams(temperature=1.0, top_k=-1, seed=-7, max_tokens=8), use_tqdm=False)
    c = llm.generate(prompts[:2], SamplingParams(temperature=1.0, seed=9, max_tokens=8), use_tqdm=False)
    assert [o["token_ids"] for o in a] == [o["token_ids"] for o in b]
    assert [o["token_ids"] for o in a] != [o["token_ids"] for o in c]


def test_out_of_vocabulary_ids_are_refused_by_the_engine(llm):
    vocab = llm.engine.config.model.vocab_size
    for params in (SamplingParams(stop_token_ids=[vocab]), SamplingParams(logit_bias={vocab + 5: 1.0})):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            llm.generate([1, 2, 3], params, use_tqdm=False)


def test_text_options_through_the_offline_llm(llm, prompts):
    """include_stop_str_in_output keeps the stop string; min_tokens puts off stop-string
    matching; skip_special_tokens=False keeps a special token's text."""
    base = dict(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    plain = llm.generate(prompts[1], SamplingParams(**base), use_tqdm=False)[0]
    ids = plain["token_ids"]
    stop = llm.tokenizer.decode(ids[2:4])
    assert stop and plain["text"].count(stop) >= 1
    cut = llm.generate(prompts[1], SamplingParams(**base, stop=[stop]), use_tqdm=False)[0]
    kept = llm.generate(prompts[1], SamplingParams(**base, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0]
    start = plain["text"].find(stop)
    assert cut["text"] == plain["text"][:start] and kept["text"] == plain["text"][:start + len(stop)]
    late = llm.generate(prompts[1], SamplingParams(**base, stop=[stop], min_tokens=MAX_NEW), use_tqdm=False)[0]
    if plain["text"].count(stop) == 1:  # completed at token 4 only: never matched
        assert late["token_ids"] == ids and late["text"] == plain["text"] and late["finish_reason"] == "length"
    eos = _eos(llm)[0]
    forced = SamplingParams(temperature=0, max_tokens=4, min_tokens=1, logit_bias={eos: 50.0})
    raw = llm.generate(prompts[1], SamplingParams(**{**forced.__dict__, "skip_special_tokens": False}),
                       use_tqdm=False)[0]
    skipped = llm.generate(prompts[1], forced, use_tqdm=False)[0]
    assert raw["token_ids"] == skipped["token_ids"] and raw["token_ids"][-1] == eos
    special = llm.tokenizer.decode([eos], skip_special_tokens=False)
    assert raw["text"].endswith(special) and not skipped["text"].endswith(special)
