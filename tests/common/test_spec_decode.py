"""Speculative decoding in one engine (common/engine/spec/): greedy output with speculation
is greedy output without it, token for token, so still transformers' (every architecture,
n-gram and draft-model proposals, preemption, chunked prefill, a second wave served from
blocks hashed while speculating); logprobs are the target's, bit for bit; every logits
feature, stop strings and structured outputs keep their output; a step can mix verified,
plain decoding and prompt-chunk rows; n > 1; an abort frees everything. Sampled output's
distribution: tests/common/test_spec_verify.py."""
from __future__ import annotations

import json

import pytest

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import ConfigError
from pdserve.common.sampling_params import StructuredOutput
from tests.support.helpers import ARCHS, mixed_prompts

MAX_NEW = 24
OPTIONS = dict(dtype="float32", num_kv_blocks=512, max_model_len=512)
# adaptive off: every decoding sequence verifies drafts every step it has some (the policy is
# tested on its own, tests/common/test_spec_policy.py); the prompt lookup also takes 1-grams,
# so random prompts give it drafts; the int8 copy of the model accepts most, not all
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False}
SELF_INT8 = {"method": "draft_model", "model": "self", "quantization": "int8", "num_speculative_tokens": 3,
             "adaptive": False}
METHODS = {"ngram": NGRAM, "self_int8": SELF_INT8}
SETTINGS = {
    "default": {},
    "preemption": dict(num_kv_blocks=24, max_model_len=256, max_num_seqs=16),  # ~1.5 long sequences fit
    "chunked": dict(max_num_batched_tokens=24),  # every prompt over 24 tokens chunks; drafts share the budget
}


def _llm(model_dir: str, spec: dict | None, **options) -> LLM:
    return LLM(model_dir, **{**OPTIONS, **options}, **({"speculative_config": spec} if spec else {}))


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=MAX_NEW, **kw)


def _ids(outs: list[dict]) -> list[list[int]]:
    return [o["token_ids"] for o in outs]


# The engines the tests below share compare outputs of the same requests; without a prefix
# cache, what an engine ran before does not decide how a prompt is chunked (a prompt partly
# served from the cache is computed in another chunk, whose float32 bits differ).
SHARED = dict(enable_prefix_caching=False)


@pytest.fixture(scope="module")
def plain(model_dirs) -> LLM:
    return _llm(model_dirs["qwen3"], None, **SHARED)


@pytest.fixture(scope="module", params=list(METHODS))
def spec(request, model_dirs) -> LLM:
    return _llm(model_dirs["qwen3"], METHODS[request.param], **SHARED)


def _check_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks, "blocks leaked"
    assert not llm.engine.speculator.policy._seqs, "the policy still holds finished sequences"


# every architecture by default; preemption and chunking on one (they are the scheduler's)
COMBOS = [(arch, method, "default") for arch in ARCHS for method in METHODS] + \
    [("qwen3", method, setting) for method in METHODS for setting in ("preemption", "chunked")]


@pytest.mark.parametrize("arch, method, setting", COMBOS, ids=["-".join(c) for c in COMBOS])
def test_greedy_matches_transformers(arch, method, setting, model_dirs, hf_greedy):
    model_dir = model_dirs[arch]
    llm = _llm(model_dir, METHODS[method], **SETTINGS[setting])
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for i, (p, o) in enumerate(zip(prompts, outs)):
        assert o["token_ids"] == hf_greedy(model_dir, p, MAX_NEW), f"prompt {i} (len {len(p)})"
    stats = llm.engine.speculator.stats
    assert stats.num_draft_tokens > 0, "nothing was verified"
    if method == "self_int8":  # both ways out of a verification were taken
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    if setting == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0, "the tiny KV budget did not force preemption"
    else:
        # prompts reaching into blocks that filled while speculating: served from the prefix cache,
        # whose hashes (and KV) are of accepted tokens only, else the output would differ
        second = [p + o["token_ids"] for p, o in zip(prompts, outs) if (len(p) + MAX_NEW) // 16 > len(p) // 16][:6]
        outs2 = llm.generate(second, _greedy(), use_tqdm=False)
        for p, o in zip(second, outs2):
            assert o["token_ids"] == hf_greedy(model_dir, p, MAX_NEW)
        assert any(o["num_cached_tokens"] > (len(p) - MAX_NEW) // 16 * 16 for p, o in zip(second, outs2)), \
            "no block filled by decoding was reused"
    _check_clean(llm)


def test_ngram_drafts_are_accepted_on_repeating_output(plain, model_dirs):
    """A repetition penalty below 1 makes the tiny model repeat itself: the prompt lookup
    then finds what comes next, and its accepted drafts change no token (the penalty
    applies to each verified row over its own history: the drafts before it)."""
    llm = _llm(model_dirs["qwen3"], NGRAM)
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)[:6]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, repetition_penalty=0.2)
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == _ids(plain.generate(prompts, params, use_tqdm=False))
    stats = llm.engine.speculator.stats
    assert stats.num_accepted_tokens >= 20 and len(stats.accepted_per_pos) >= 2, stats


def test_logprobs_are_the_targets_bit_for_bit(plain, spec):
    """Each verified row is computed as the decode step at its position would be (the same
    kernels), so the target's logprobs are the same floats as without speculation."""
    prompts = mixed_prompts(plain.engine.config.model.vocab_size, seed=3)[:8]
    params = _greedy(logprobs=5)
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert [o["logprobs"] for o in got] == [o["logprobs"] for o in want]
    assert spec.engine.speculator.stats.num_draft_tokens > 0


def _feature_params(plain: LLM, prompt: list[int]) -> dict[str, SamplingParams]:
    base = plain.generate(prompt, _greedy(), use_tqdm=False)[0]["token_ids"]
    eos = min(plain.engine.eos_token_ids)
    stop_text = plain.tokenizer.decode(base[9:11])
    return {
        "penalties": _greedy(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3),
        "logit_bias": _greedy(logit_bias={t: -100.0 for t in base[2:8]} | {base[0]: 4.0}),
        "min_tokens": _greedy(logit_bias={eos: 8.0}, min_tokens=6),  # EOS is the choice once allowed
        "stop_token_ids": _greedy(stop_token_ids=[base[7], base[12]]),
        "stop_strings": _greedy(stop=[stop_text] if stop_text.strip() else ["zz"]),
        "max_tokens": SamplingParams(temperature=0, max_tokens=7),
        "ignore_eos": _greedy(logit_bias={eos: 6.0}, ignore_eos=True),
    }


def test_logits_features_and_stops_keep_their_output(plain, spec):
    prompts = mixed_prompts(plain.engine.config.model.vocab_size, seed=5)[3:9]
    for name, params in _feature_params(plain, prompts[0]).items():
        want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
        for w, g in zip(want, got):
            assert (g["token_ids"], g["text"], g["finish_reason"]) == (w["token_ids"], w["text"], w["finish_reason"]), name
    _check_clean(spec)


FIXED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "color", "n"], "additionalProperties": False}


def test_structured_output_keeps_its_output(plain, spec):
    """The grammar's mask of each verified row is the one after the drafts before it; the
    matcher is rolled back after, and a draft that ends the grammar ends the output."""
    prompts = mixed_prompts(plain.engine.config.model.vocab_size, seed=9)[:6]
    so = StructuredOutput("json", json.dumps(FIXED))
    params = SamplingParams(temperature=0, max_tokens=64, structured=so)
    want, got = plain.generate(prompts, params, use_tqdm=False), spec.generate(prompts, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    for o in got:
        assert o["finish_reason"] == "stop" and set(json.loads(o["text"])) == {"ok", "color", "n"}
    choice = SamplingParams(temperature=0, max_tokens=16, structured=StructuredOutput("choice", '["alpha beta", "gamma"]'))
    assert _ids(spec.generate(prompts, choice, use_tqdm=False)) == _ids(plain.generate(prompts, choice, use_tqdm=False))
    _check_clean(spec)


def test_a_step_mixes_verified_plain_and_prompt_rows(model_dirs, hf_greedy, monkeypatch):
    """With a small token budget prompts are chunked while others decode; the prompt lookup
    has drafts for some sequences and not others: one step holds all three kinds of rows."""
    model_dir = model_dirs["llama"]
    llm = _llm(model_dir, NGRAM, max_num_batched_tokens=40)
    runner = llm.engine.runner
    kinds: list[set[str]] = []
    real = runner.execute

    def execute(batch, layer_hook=None):
        kinds.append({"verify" if s.spec_token_ids else "decode" if n == 1 else "prompt"
                      for s, n in zip(batch.seqs, batch.num_tokens)})
        return real(batch, layer_hook)

    monkeypatch.setattr(runner, "execute", execute)
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)
    outs = llm.generate(prompts, _greedy(), use_tqdm=False)
    for p, o in zip(prompts, outs):
        assert o["token_ids"] == hf_greedy(model_dir, p, MAX_NEW)
    assert any(k == {"verify", "decode", "prompt"} for k in kinds), kinds
    assert any(k == {"verify", "decode"} for k in kinds), kinds  # the native decode stack's rows


def test_n_choices(plain, spec):
    prompts = mixed_prompts(plain.engine.config.model.vocab_size, seed=4)[4:8]
    greedy = _greedy(n=3)
    for w, g in zip(plain.generate(prompts, greedy, use_tqdm=False), spec.generate(prompts, greedy, use_tqdm=False)):
        assert _ids(g["outputs"]) == _ids(w["outputs"]) == [w["token_ids"]] * 3
    sampled = SamplingParams(temperature=0.9, max_tokens=MAX_NEW, n=3, seed=11)
    first, again = (spec.generate(prompts, sampled, use_tqdm=False) for _ in range(2))
    assert [_ids(o["outputs"]) for o in first] == [_ids(o["outputs"]) for o in again], "a seed reproduces its output"
    assert all(len({tuple(t) for t in _ids(o["outputs"])}) > 1 for o in first), "choices sample apart"
    _check_clean(spec)


def test_abort_while_speculating_frees_everything(spec):
    engine = spec.engine
    prompts = mixed_prompts(engine.config.model.vocab_size, seed=2)[5:11]
    seqs = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)) for p in prompts]
    drafted = engine.speculator.stats.num_draft_tokens
    for _ in range(40):
        engine.step()
        if engine.speculator.stats.num_draft_tokens > drafted + 8:
            break
    assert engine.speculator.stats.num_draft_tokens > drafted + 8, "no verification ran before the abort"
    for seq in seqs:
        engine.abort(seq)
    assert not engine.has_work()
    _check_clean(spec)
    proposer_states = getattr(engine.speculator.proposer, "_states", {})
    assert not proposer_states, "the draft model still holds aborted sequences"


def test_a_draft_model_from_another_folder(model_dirs, hf_greedy, tmp_path):
    """Another model with the target's tokenizer drafts (here a different architecture:
    it seldom agrees, which changes nothing but speed); another tokenizer is refused."""
    target = model_dirs["qwen3"]
    llm = _llm(target, {"model": model_dirs["llama"], "num_speculative_tokens": 2, "adaptive": False})
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)[:8]
    for p, o in zip(prompts, llm.generate(prompts, _greedy(), use_tqdm=False)):
        assert o["token_ids"] == hf_greedy(target, p, MAX_NEW)
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    from pdserve.common.loading.model_factory import make_model
    other = make_model(tmp_path / "other", "qwen3", "tiny", seed=2)  # its own tokenizer
    with pytest.raises(ConfigError, match="another tokenizer"):
        _llm(target, {"model": str(other), "num_speculative_tokens": 2})


@pytest.mark.parametrize("bad, words", [
    ('{"method": "ngram"}', "needs method and num_speculative_tokens"),
    ('{"method": "eagle", "num_speculative_tokens": 2}', "method must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "model": "self"}', "takes no model"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a model"),
    ('{"model": "self", "num_speculative_tokens": 2, "quantization": "int3"}', "quantization must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": 99}', "num_speculative_tokens must be in"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min <= prompt_lookup_max"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}', "unknown key"),
    ('[1, 2]', "must be a JSON object"),
    ('{"method": ', "not valid JSON"),
])
def test_a_bad_speculative_config_is_refused_naming_the_problem(model_dirs, bad, words):
    with pytest.raises(ConfigError, match=words):
        LLM(model_dirs["qwen3"], speculative_config=bad)


def test_a_missing_draft_folder_is_refused(model_dirs):
    with pytest.raises(ConfigError, match="config.json not found"):  # read when the engine starts
        _llm(model_dirs["qwen3"], {"model": "/no/such/folder", "num_speculative_tokens": 2})


@pytest.mark.parametrize("path", ["per_op", "decode_graphs"])
def test_other_decode_paths_verify_exactly(path, model_dirs, hf_greedy, monkeypatch):
    """Without the native decode stack (the GPU's way: rows through the model's forward and
    its paged decode attention), and under the bucketed decode buffers (CUDA graphs on a
    GPU: verifications run eagerly), greedy output is still transformers'."""
    options = {}
    if path == "per_op":
        monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    else:
        options["decode_graphs"] = True
    model_dir = model_dirs["qwen2"]
    llm = _llm(model_dir, SELF_INT8, **options)
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=7)[:10]
    for p, o in zip(prompts, llm.generate(prompts, _greedy(), use_tqdm=False)):
        assert o["token_ids"] == hf_greedy(model_dir, p, MAX_NEW)
    assert llm.engine.speculator.stats.num_accepted_tokens > 0
    _check_clean(llm)
