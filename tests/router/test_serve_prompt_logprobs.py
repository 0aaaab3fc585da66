"""Prompt log-probabilities through `pdserve serve` (float32, a 16-token step so a prompt
is computed in chunks) on 1 prefill + 1 decode worker (P computes them, KVReady carries
them to D, D's first output to the router) and on a colocated worker: the evaluation
harnesses' `echo` + `logprobs` + `max_tokens: 0` with the openai SDK, vLLM's
`prompt_logprobs` on completions and chat, echo streamed, the ZeroMQ client; every value
is within float32's reach of transformers' float64 log_softmax (tests/support/numerics.py:
at most 8x transformers' own float32 error), a prompt sent twice (its prefix cached) included; a scored request holds no block afterwards; bad values get a 400
naming the field."""
from __future__ import annotations

import contextlib
import signal

import httpx
import openai
import pytest

from pdserve.router.client import Client, ServerError
from tests.support.numerics import LogprobReference, logprob_reference
from tests.support.reliability_harness import wait_blocks_baseline
from tests.support.serving import CHAT, MAX_MODEL_LEN, PROMPTS, chat_ids, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")
PROMPT = PROMPTS[2]  # longer than the 16-token step
FLAGS = ("--dtype", "float32", "--max-num-batched-tokens", "16")


@pytest.fixture(scope="module")
def reference(model_dir):
    """ids -> transformers' log_softmax in float64, with the float32 tolerance (row t
    predicts token t + 1)."""
    return logprob_reference(model_dir)


def _serve(model_dir, tmp_path_factory, name, roles):
    served = start_server(model_dir, tmp_path_factory.mktemp(name), roles, MAX_MODEL_LEN, extra=FLAGS)
    try:
        yield served
    finally:
        with contextlib.suppress(Exception):
            stop_server(served, signal.SIGTERM)


@pytest.fixture(scope="module")
def pd_f32(model_dir, tmp_path_factory):
    yield from _serve(model_dir, tmp_path_factory, "serve_pd_plp", ["--prefill", "1", "--decode", "1"])


@pytest.fixture(scope="module")
def colocated_f32(model_dir, tmp_path_factory):
    yield from _serve(model_dir, tmp_path_factory, "serve_col_plp", ["--colocated", "1", "--prefill", "0",
                                                                     "--decode", "0"])


@pytest.fixture(params=["pd_f32", "colocated_f32"])
def served(request):
    return request.getfixturevalue(request.param)


def _client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=60)


def _check_vllm_form(entries: list, ids: list[int], ref: LogprobReference, k: int, tok) -> None:
    """vLLM's prompt_logprobs: None, then {token id: {logprob, rank, decoded_token}}."""
    assert len(entries) == len(ids) and entries[0] is None
    for j in range(1, len(ids)):
        row, entry = ref[j - 1], entries[j]  # float64
        mine = entry[str(ids[j])]
        assert mine["logprob"] == pytest.approx(row[ids[j]].item(), abs=ref.tol)
        v = row[ids[j]]  # its rank, up to ties within float32's reach
        assert int((row > v + ref.tol).sum()) + 1 <= mine["rank"] <= int((row > v - ref.tol).sum()) + 1
        assert mine["decoded_token"] == tok.decode([ids[j]], skip_special_tokens=False)
        top_vals, top_ids = row.topk(k)
        for r, (i, v) in enumerate(zip(top_ids.tolist(), top_vals.tolist()), 1):
            if str(i) != str(ids[j]) or mine["rank"] == r:
                assert entry[str(i)]["logprob"] == pytest.approx(v, abs=ref.tol)
        assert len(entry) in (k, k + 1)


def test_echo_logprobs_max_tokens_zero_scores_the_prompt(served, tok, reference):
    """Exactly what evaluation harnesses send, twice: the second time the prompt's blocks
    are in the prefix cache and must be computed again; no block is held afterwards."""
    ids = tok.encode(PROMPT)
    ref = reference(ids)
    client = _client(served)
    for _ in range(2):
        res = client.completions.create(model="qwen3", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0)
        choice = res.choices[0]
        assert choice.text == PROMPT and choice.finish_reason == "length"
        assert res.usage.completion_tokens == 0 and res.usage.prompt_tokens == len(ids)
        lp = choice.logprobs
        assert lp.tokens == [tok.decode([t], skip_special_tokens=False) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
        for j in range(1, len(ids)):
            assert lp.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=ref.tol)
            assert len(lp.top_logprobs[j]) in (1, 2)
        assert lp.text_offset == [sum(len(t) for t in lp.tokens[:j]) for j in range(len(ids))]
        _check_vllm_form(choice.model_extra["prompt_logprobs"], ids, ref, 1, tok)
    wait_blocks_baseline(served, list(served.info["workers"]))


def test_prompt_logprobs_with_generation_completions_and_chat(served, tok, reference):
    client = _client(served)
    ids = tok.encode(PROMPT)
    res = client.completions.create(model="qwen3", prompt=PROMPT, max_tokens=3, temperature=0,
                                    extra_body={"prompt_logprobs": 4})
    choice = res.choices[0]
    assert choice.logprobs is None and not choice.text.startswith(PROMPT)
    _check_vllm_form(choice.model_extra["prompt_logprobs"], ids, reference(ids), 4, tok)
    # greedy output is untouched by asking
    plain = client.completions.create(model="qwen3", prompt=PROMPT, max_tokens=3, temperature=0)
    assert choice.text == plain.choices[0].text and "prompt_logprobs" not in (plain.choices[0].model_extra or {})
    cids = chat_ids(tok, CHAT)
    chat = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=2, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    _check_vllm_form(chat.model_extra["prompt_logprobs"], cids, reference(cids), 0, tok)


def test_echo_streamed_puts_the_prompt_in_the_first_chunk(served, tok, reference):
    ids = tok.encode(PROMPT)
    ref = reference(ids)
    stream = _client(served).completions.create(model="qwen3", prompt=PROMPT, echo=True, logprobs=2, max_tokens=3,
                                                temperature=0, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    assert chunks[0].text.startswith(PROMPT)
    first = chunks[0].logprobs
    assert first.tokens[:len(ids)] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert first.token_logprobs[0] is None
    for j in range(1, len(ids)):
        assert first.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=ref.tol)
    text = "".join(c.text for c in chunks)
    whole = _client(served).completions.create(model="qwen3", prompt=PROMPT, echo=True, max_tokens=3, temperature=0)
    assert text == whole.choices[0].text
    offsets = [o for c in chunks for o in c.logprobs.text_offset]
    assert offsets == sorted(offsets) and len(offsets) == len(ids) + 3


def test_zmq_client_prompt_logprobs(served, tok, reference):
    ids = tok.encode(PROMPT)
    ref = reference(ids)
    with Client(served.zmq, timeout_s=60) as c:
        out = c.generate(ids, max_tokens=0, prompt_logprobs=2, temperature=0)
    assert out.token_ids == [] and out.finish_reason == "length" and out.prompt_logprobs[0] is None
    for j in range(1, len(ids)):
        lp = out.prompt_logprobs[j]
        assert lp.logprob == pytest.approx(ref[j - 1, ids[j]].item(), abs=ref.tol)
        assert lp.top_logprobs == pytest.approx(ref[j - 1].topk(2).values.tolist(), abs=ref.tol)


@pytest.mark.parametrize("path,body,field", [
    ("completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ("completions", {"prompt": "hi", "max_tokens": 0, "logprobs": 1}, "max_tokens"),
    ("completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "max_tokens": 0, "prompt_logprobs": 1}, "max_tokens"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": 30}, "prompt_logprobs"),
    ("chat/completions", {"messages": CHAT, "prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_bad_values_are_refused_naming_the_field(colocated_f32, path, body, field):
    resp = httpx.post(f"{colocated_f32.http}/{path}", json={"model": "qwen3", **body}, timeout=30)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert field in err["message"] and err.get("param") == field
    if body.get("prompt_logprobs") == -1:  # vLLM's "whole vocabulary": refused, saying why
        assert "every vocabulary token" in err["message"] and "--max-logprobs" in err["message"]


def test_prompt_logprobs_minus_one_is_refused_on_the_zeromq_wire_too(colocated_f32):
    with Client(colocated_f32.zmq, timeout_s=60) as c:
        with pytest.raises(ServerError, match="every vocabulary token at each prompt position"):
            c.generate([1, 2, 3], max_tokens=0, prompt_logprobs=-1)


def test_echo_and_prompt_logprobs_with_n_choices(served, tok, reference):
    """n > 1: the prompt is computed once; each choice echoes it with its logprobs and
    carries vLLM's prompt_logprobs."""
    ids = tok.encode(PROMPT)
    ref = reference(ids)
    res = _client(served).completions.create(model="qwen3", prompt=PROMPT, echo=True, logprobs=1, max_tokens=2,
                                             n=2, temperature=0.8, seed=5)
    assert len(res.choices) == 2
    for choice in res.choices:
        assert choice.text.startswith(PROMPT) and len(choice.logprobs.tokens) == len(ids) + 2
        assert choice.logprobs.token_logprobs[0] is None
        for j in range(1, len(ids)):
            assert choice.logprobs.token_logprobs[j] == pytest.approx(ref[j - 1, ids[j]].item(), abs=ref.tol)
        _check_vllm_form(choice.model_extra["prompt_logprobs"], ids, ref, 1, tok)
