"""Structured output (common/engine/grammar.py) in one engine: every output that ends by
its grammar parses as JSON and validates against its schema, on the real default model
and on a make-model model; an output cut by max_tokens is a prefix the grammar accepts;
regex and choice outputs match; plain requests batched with constrained ones stay
token-exact; a preempted constrained sequence stays in sync; a spec that does not
compile is refused; compiled grammars are cached in a bounded LRU."""
from __future__ import annotations

import dataclasses
import json
import re

import jsonschema
import pytest
import xgrammar as xgr

from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.grammar import Grammars
from pdserve.common.sampling_params import StructuredOutput
from pdserve.common.validation import RequestError
from tests.support.helpers import mixed_prompts

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# every value bounded: a random model cannot run on inside a string, so it always ends
FIXED = {"type": "object", "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green", "blue"]},
                                          "n": {"type": "integer", "minimum": 0, "maximum": 9}},
         "required": ["ok", "color", "n"], "additionalProperties": False}


def _json(schema: dict) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _check_json(out: dict, schema: dict | None) -> None:
    value = json.loads(out["text"])
    if schema is not None:
        jsonschema.validate(value, schema)


def _grammar_accepts(llm: LLM, so: StructuredOutput, tokens: list[int]) -> bool:
    matcher = xgr.GrammarMatcher(llm.engine.runner.grammars.compile(so))
    return all(matcher.accept_token(t) for t in tokens)


@pytest.fixture(scope="module")
def real(real_model_dir) -> LLM:
    return LLM(real_model_dir, dtype="float32", num_kv_blocks=256, max_model_len=1024)


@pytest.fixture(scope="module")
def tiny(model_dirs) -> LLM:
    return LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=256, max_model_len=512)


def test_real_model_json_schema_and_json_object_outputs_validate(real):
    prompts = [_chat("Give me a person as JSON with a name and an age."),
               _chat("Describe a cat called Tom, 3 years old, in JSON."),
               _chat("Who wrote Hamlet? Answer in JSON.")]
    params = [SamplingParams(temperature=0, max_tokens=80, structured=_json(PERSON)),
              SamplingParams(temperature=0.9, seed=7, max_tokens=80, structured=_json(PERSON)),
              SamplingParams(temperature=0, max_tokens=80, structured=StructuredOutput("json_object"))]
    outs = real.generate(prompts, params, use_tqdm=False)
    for out, schema in zip(outs, [PERSON, PERSON, None]):
        assert out["finish_reason"] == "stop", out
        _check_json(out, schema)


def test_real_model_regex_and_choice_match(real):
    prompts = [_chat("What is the capital of France?"), _chat("Is the sky blue? Answer yes or no."),
               _chat("Give a date.")]
    params = [SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput("choice", '["Paris", "Lyon"]')),
              SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                             structured=StructuredOutput("choice", '["yes", "no", "maybe so"]')),
              SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput("regex", r"\d{4}-\d{2}-\d{2}"))]
    outs = real.generate(prompts, params, use_tqdm=False)
    assert all(o["finish_reason"] == "stop" for o in outs), outs
    assert outs[0]["text"] in ("Paris", "Lyon")
    assert outs[1]["text"] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", outs[2]["text"]), outs[2]


def test_make_model_outputs_validate_and_cut_outputs_are_prefixes(tiny):
    prompts = mixed_prompts(tiny.engine.config.model.vocab_size, seed=5)[:6]
    params = [SamplingParams(temperature=t, seed=i, max_tokens=60, structured=_json(FIXED))
              for i, t in enumerate([0, 1.0, 1.0, 0.7, 1.0, 0])]
    outs = tiny.generate(prompts, params, use_tqdm=False)
    for out in outs:
        assert out["finish_reason"] == "stop", out
        _check_json(out, FIXED)
    # cut by max_tokens: not JSON yet, but a prefix the grammar accepts
    cut = tiny.generate(prompts[:3], SamplingParams(temperature=1.0, seed=1, max_tokens=4, structured=_json(FIXED)),
                        use_tqdm=False)
    for out in cut:
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 4
        assert _grammar_accepts(tiny, _json(FIXED), out["token_ids"])
        with pytest.raises(json.JSONDecodeError):
            json.loads(out["text"])


def test_plain_rows_stay_token_exact_beside_constrained_ones(tiny):
    prompts = mixed_prompts(tiny.engine.config.model.vocab_size, seed=9)[:6]
    plain = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=5, max_tokens=20, ignore_eos=True)
    alone = tiny.generate(prompts[:3], [plain, seeded, plain], use_tqdm=False)
    constrained = [SamplingParams(temperature=1.0, seed=2, max_tokens=40, structured=_json(FIXED)),
                   SamplingParams(temperature=0, max_tokens=20, structured=StructuredOutput("regex", "[a-z ]+"))]
    mixed = tiny.generate(prompts[:3] + prompts[3:5], [plain, seeded, plain] + constrained, use_tqdm=False)
    assert [o["token_ids"] for o in mixed[:3]] == [o["token_ids"] for o in alone]
    _check_json(mixed[3], FIXED)
    assert _grammar_accepts(tiny, constrained[1].structured, mixed[4]["token_ids"])


def test_preempted_constrained_sequences_stay_in_sync(model_dirs):
    llm = LLM(model_dirs["qwen3"], dtype="float32", num_kv_blocks=20, max_model_len=256, max_num_seqs=16)
    prompts = mixed_prompts(llm.engine.config.model.vocab_size, seed=2)[:8]
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 20,
              "maxItems": 20}
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, seed=4, max_tokens=200, structured=_json(schema)),
                        use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0, "the test must preempt"
    for out in outs:
        assert out["finish_reason"] == "stop", out
        _check_json(out, schema)


def test_a_spec_that_does_not_compile_is_refused(tiny):
    for so in [StructuredOutput("json", '{"type": 5}'), StructuredOutput("regex", "a("),
               StructuredOutput("grammar", "root ::= "), StructuredOutput("choice", "[]")]:
        with pytest.raises(RequestError, match="does not compile"):
            tiny.generate([1, 2, 3], SamplingParams(max_tokens=2, structured=so), use_tqdm=False)


def test_compiled_grammars_are_an_lru(model_dirs):
    vocab = json.loads(open(f"{model_dirs['qwen3']}/config.json").read())["vocab_size"]
    g = Grammars(model_dirs["qwen3"], vocab, cache_size=2)
    a, b, c = (StructuredOutput("regex", r) for r in ("a+", "b+", "c+"))
    first = g.compile(a)
    assert g.compile(a) is first
    g.compile(b)
    g.compile(a)  # a is the most recent now: c evicts b
    g.compile(c)
    assert set(g._cache) == {("regex", "a+"), ("regex", "c+")}


def test_structured_crosses_the_wire_as_a_typed_map():
    from pdserve.common.wire.messages import SubmitRequest, decode, encode
    so = StructuredOutput("json", json.dumps(FIXED))
    sub = SubmitRequest(request_id="r", sampling=SamplingParams(structured=so), prompt_token_ids=[1, 2])
    back = decode(encode(sub))
    assert back.sampling.structured == so and isinstance(back.sampling.structured, StructuredOutput)
    after = dataclasses.replace(so, reasoning_end=151668)
    assert decode(encode(dataclasses.replace(sub, sampling=SamplingParams(structured=after)))).sampling.structured == after


def test_a_grammar_with_reasoning_end_starts_after_that_token(tiny, model_dirs):
    """Up to the first `reasoning_end` token the output is the unconstrained one (same
    seed), token for token; after it, the grammar's; a step where no row's grammar
    applies fills no mask."""
    from pdserve.common.text.tokenizer import Tokenizer
    end = 7  # any id: a bias makes the random model write it after a few tokens
    prompts = mixed_prompts(tiny.engine.config.model.vocab_size, seed=11)[:4]
    so = StructuredOutput("json", json.dumps(FIXED), reasoning_end=end)
    free = [SamplingParams(temperature=1.0, seed=s, max_tokens=80, ignore_eos=True, logit_bias={end: 6.0})
            for s in range(4)]
    bound = [dataclasses.replace(p, structured=so) for p in free]
    outs = tiny.generate(prompts + prompts, free + bound, use_tqdm=False)
    tok = Tokenizer(model_dirs["qwen3"])
    ends = []
    for a, b in zip(outs[:4], outs[4:]):
        k = a["token_ids"].index(end) + 1
        ends.append(k)
        assert b["token_ids"][:k] == a["token_ids"][:k] and b["finish_reason"] == "stop"
        jsonschema.validate(json.loads(tok.decode(b["token_ids"][k:])), FIXED)
        assert a["token_ids"][k:] != b["token_ids"][k:]
    assert max(ends) > 2, ends  # some reasoning came before the grammar
    never = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logit_bias={end: -100.0})
    plain, waiting = tiny.generate(prompts[:1] * 2, [never, dataclasses.replace(never, structured=so)], use_tqdm=False)
    assert waiting["token_ids"] == plain["token_ids"]  # reasoning never ends: the grammar never applies
    assert not _grammar_accepts(tiny, so, plain["token_ids"])


def test_min_tokens_yields_to_a_grammar_that_allows_only_its_end(tiny):
    """min_tokens hides the ends until then, except where the grammar allows nothing but
    its end: there the request stops as without min_tokens (sampled too: no row samples
    from no token). Where the grammar leaves another way, min_tokens holds."""
    eos = min(tiny.engine.eos_token_ids)
    prompt = mixed_prompts(tiny.engine.config.model.vocab_size, seed=3)[0]
    choice = StructuredOutput("choice", '["yes"]')
    eager = SamplingParams(temperature=0, max_tokens=30, logit_bias={eos: 100.0}, structured=StructuredOutput(
        "regex", "[a-z]+"))  # the model would end after one token
    rows = [SamplingParams(temperature=t, seed=1, max_tokens=30, min_tokens=m, structured=choice)
            for t in (0, 1.0) for m in (0, 10)] + [eager, dataclasses.replace(eager, min_tokens=6)]
    outs = tiny.generate([prompt] * len(rows), rows, use_tqdm=False)
    for free, held in (outs[0:2], outs[2:4]):
        assert held["token_ids"] == free["token_ids"] and held["finish_reason"] == "stop" and held["text"] == "yes"
        assert len(held["token_ids"]) < 10
    quick, held = outs[4:]
    assert quick["finish_reason"] == held["finish_reason"] == "stop"
    assert len(quick["token_ids"]) < 6 <= len(held["token_ids"]) and re.fullmatch("[a-z]+", held["text"])
