"""The sampling and stop fields of an OpenAI body, through `pdserve serve` with one prefill
and one decode worker: each maps to its SamplingParams field, and the prefill worker
(first token) and the decode worker (the rest) apply it as the offline engine does, so
the answer equals the offline `LLM`'s token for token (seeded random ones too)."""
from __future__ import annotations

import httpx
import pytest

from pdserve.common import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

PROMPT = "The router sends each request to"
MAX_NEW = 8


@pytest.fixture(scope="module")
def llm(model_dir) -> LLM:
    return LLM(model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def plain(llm) -> dict:
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0]


def _eos(llm: LLM) -> int:
    return min(llm.engine.eos_token_ids)


def _cases(llm: LLM, plain: dict) -> dict[str, tuple[dict, dict]]:
    """name -> (the body's extra fields, the SamplingParams fields they mean)."""
    ids, eos = plain["token_ids"], _eos(llm)
    stop_text = llm.tokenizer.decode(ids[2:4])
    return {
        "repetition_penalty": ({"repetition_penalty": 1.8}, {"repetition_penalty": 1.8}),
        "presence_penalty": ({"presence_penalty": 1.9}, {"presence_penalty": 1.9}),
        "frequency_penalty": ({"frequency_penalty": 1.7}, {"frequency_penalty": 1.7}),
        "logit_bias": ({"logit_bias": {str(ids[0]): -100, str(ids[3]): 4.5}}, {"logit_bias": {ids[0]: -100.0,
                                                                                                ids[3]: 4.5}}),
        "stop_token_ids": ({"stop_token_ids": [ids[3]]}, {"stop_token_ids": [ids[3]]}),
        "min_tokens": ({"min_tokens": 3, "ignore_eos": False, "logit_bias": {str(eos): 40}},
                       {"min_tokens": 3, "ignore_eos": False, "logit_bias": {eos: 40.0}}),
        "min_p": ({"temperature": 1.3, "min_p": 0.2, "seed": 11}, {"temperature": 1.3, "min_p": 0.2, "seed": 11}),
        "negative_seed": ({"temperature": 1.0, "seed": -3}, {"temperature": 1.0, "seed": -3}),
        "top_k_0": ({"temperature": 1.0, "top_k": 0, "seed": 5}, {"temperature": 1.0, "top_k": 0, "seed": 5}),
        "include_stop_str_in_output": ({"stop": [stop_text], "include_stop_str_in_output": True},
                                       {"stop": [stop_text], "include_stop_str_in_output": True}),
        "skip_special_tokens": ({"skip_special_tokens": False, "ignore_eos": False, "min_tokens": 2,
                                 "logit_bias": {str(eos): 40}},
                                {"skip_special_tokens": False, "ignore_eos": False, "min_tokens": 2,
                                 "logit_bias": {eos: 40.0}}),
    }


CASES = ["repetition_penalty", "presence_penalty", "frequency_penalty", "logit_bias", "stop_token_ids", "min_tokens",
         "min_p", "negative_seed", "top_k_0", "include_stop_str_in_output", "skip_special_tokens"]


@pytest.mark.parametrize("name", CASES)
def test_field_through_prefill_and_decode_equals_offline(pd, llm, plain, name):
    body, fields = _cases(llm, plain)[name]
    base = {"temperature": 0, "max_tokens": MAX_NEW, "ignore_eos": True}
    want = llm.generate(PROMPT, SamplingParams(**{**base, **fields}), use_tqdm=False)[0]
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        res = http.post("/v1/completions", json={"prompt": PROMPT, **base, **body})
    assert res.status_code == 200, res.text
    choice = res.json()["choices"][0]
    assert choice["token_ids"] == want["token_ids"] and choice["text"] == want["text"]
    assert choice["finish_reason"] == want["finish_reason"]
    if name not in ("min_p", "negative_seed", "top_k_0", "include_stop_str_in_output"):
        assert want["token_ids"] != plain["token_ids"], "the field changed nothing: the test would not see it lost"
    if name == "include_stop_str_in_output":
        assert want["text"].endswith(fields["stop"][0]) and want["finish_reason"] == "stop"
    if name == "skip_special_tokens":
        assert want["text"].endswith(llm.tokenizer.decode([_eos(llm)], skip_special_tokens=False))


BAD = [  # (field, value, text the 400's message must contain)
    ("repetition_penalty", 0, "repetition_penalty"),
    ("presence_penalty", 2.5, "presence_penalty"),
    ("frequency_penalty", -3, "frequency_penalty"),
    ("min_p", 1.5, "min_p"),
    ("min_tokens", 99, "min_tokens"),
    ("stop_token_ids", [-1], "stop_token_ids"),
    ("stop_token_ids", [10**9], "vocabulary"),
    ("logit_bias", {"5": 101}, "logit_bias"),
    ("logit_bias", {"abc": 1}, "logit_bias"),
    ("logit_bias", {str(10**9): 1}, "vocabulary"),
    ("skip_special_tokens", "no", "skip_special_tokens"),
]


@pytest.mark.parametrize("field,value,needle", BAD, ids=[f"{f}={v}" for f, v, _ in BAD])
def test_bad_values_are_refused_naming_the_field(pd, field, value, needle):
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        res = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, field: value})
    assert res.status_code == 400, res.text
    assert needle in res.json()["error"]["message"], res.text
