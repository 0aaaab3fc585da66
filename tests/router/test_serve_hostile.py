"""`pdserve serve` against hostile and heavy input (issue 12, client-facing edge): values
that once took a worker down or made the router answer 500, over HTTP and ZeroMQ. Each
gets a 4xx OpenAI error object (or a correct answer), and right after, the deployment
still serves a normal request token for token like transformers."""
from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.serving import RawClient

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

HI = {"prompt": "hi", "max_tokens": 3}
CHAT_HI = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

HOSTILE_HTTP = [  # (name, path, JSON body or raw bytes, status, text the error message must contain)
    ("top_k_2_63", "completions", {**HI, "temperature": 1.0, "top_k": 2**63}, 400, "top_k"),
    ("top_k_2_70", "completions", {**HI, "top_k": 2**70}, 400, "top_k"),
    ("max_tokens_2_64", "completions", {**HI, "max_tokens": 2**64}, 400, "max_tokens"),
    ("max_tokens_2_64_chat", "chat/completions", {**CHAT_HI, "max_tokens": 2**64}, 400, "max_tokens"),
    ("seed_2_64", "completions", {**HI, "seed": 2**64}, 400, "seed"),
    ("temperature_huge", "completions", {**HI, "temperature": 1e308}, 400, "temperature"),
    ("temperature_int_huge", "completions", {**HI, "temperature": 10**400}, 400, "temperature"),
    ("top_p_zero", "completions", {**HI, "top_p": 0}, 400, "top_p"),
    ("stop_many", "completions", {**HI, "stop": ["x"] * 1000}, 400, "stop"),
    ("stop_long", "completions", {**HI, "stop": ["x" * 100_000]}, 400, "stop"),
    ("lone_surrogate_prompt", "completions", b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "Unicode"),
    ("lone_surrogate_chat", "chat/completions",
     b'{"messages": [{"role": "user", "content": "a\\udfffb"}], "max_tokens": 2}', 400, "Unicode"),
    ("lone_surrogate_stop", "completions", b'{"prompt": "hi", "stop": "\\ud800", "max_tokens": 2}', 400, "Unicode"),
    ("invalid_utf8", "completions", b'{"prompt": "\xff\xfe\xfd", "max_tokens": 2}', 400, "UTF-8"),
    ("deep_nesting", "completions", b"[" * 100_000 + b"]" * 100_000, 400, "nested"),
    ("deep_nesting_object", "completions", b'{"a":' * 50_000 + b"1" + b"}" * 50_000, 400, "nested"),
    ("unknown_model", "completions", {**HI, "model": "gpt-17"}, 404, "gpt-17"),
    ("logprobs_21", "completions", {**HI, "logprobs": 21}, 400, "logprobs"),
    ("chat_top_logprobs_21", "chat/completions", {**CHAT_HI, "logprobs": True, "top_logprobs": 21}, 400,
     "top_logprobs"),
    ("chat_echo", "chat/completions", {**CHAT_HI, "echo": True}, 400, "echo"),
    ("echo_max_tokens_0_streamed_prompt_logprobs", "completions", {**HI, "echo": True, "max_tokens": 0, "stream": True,
                                                                 "prompt_logprobs": 1}, 400, "prompt_logprobs"),
    ("best_of", "completions", {**HI, "best_of": 3}, 400, "best_of"),
    ("suffix", "completions", {**HI, "suffix": "end"}, 400, "suffix"),
    ("presence_penalty", "completions", {**HI, "presence_penalty": 2.5}, 400, "presence_penalty"),
    ("tools", "chat/completions", {**CHAT_HI, "tools": [{"type": "function"}]}, 400, "tools"),
    ("prompt_15_mb", "completions", {"prompt": "a" * (15 * 1024 * 1024), "max_tokens": 2}, 400, "characters"),
]

ANSWERED_HTTP = [  # honoured, not refused: the same greedy answer as temperature 0
    ("temperature_1e-300", {"temperature": 1e-300}),
    ("top_p_1e-300", {"temperature": 1.0, "top_p": 1e-300}),
    ("top_k_vocab_plus", {"temperature": 1.0, "top_k": 2**31 - 1, "top_p": 1e-300}),
    ("harmless_openai_defaults", {"temperature": 0, "logprobs": None, "echo": False, "best_of": 1,
                                  "presence_penalty": 0.0, "frequency_penalty": 0}),
]

NORMAL_PROMPT = "The router sends each request to"


def _post(http: httpx.Client, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def _openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text[:500]
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    return err


@pytest.fixture(scope="module")
def greedy_normal(pd, tok, hf_greedy) -> list[int]:
    return hf_greedy(pd.model_dir, tok.encode(NORMAL_PROMPT), 8)


def _serves_normally(http: httpx.Client, want: list[int]) -> None:
    assert http.get("/health").status_code == 200
    res = http.post("/v1/completions", json={"prompt": NORMAL_PROMPT, "max_tokens": 8, "temperature": 0})
    assert res.status_code == 200, res.text
    assert res.json()["choices"][0]["token_ids"] == want


@pytest.mark.parametrize("path,body,status,needle", [c[1:] for c in HOSTILE_HTTP], ids=[c[0] for c in HOSTILE_HTTP])
def test_hostile_http_is_a_4xx_openai_error(pd, greedy_normal, path, body, status, needle):
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        err = _openai_error(_post(http, f"/v1/{path}", body), status)
        assert needle in err["message"], err
        if isinstance(body, dict) and not body.get("stream"):  # the same refusal when streamed
            _openai_error(_post(http, f"/v1/{path}", {**body, "stream": True}), status)
        _serves_normally(http, greedy_normal)


@pytest.mark.parametrize("extra", [c[1] for c in ANSWERED_HTTP], ids=[c[0] for c in ANSWERED_HTTP])
def test_extreme_but_valid_sampling_is_answered_greedily(pd, greedy_normal, extra):
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        res = http.post("/v1/completions", json={"prompt": NORMAL_PROMPT, "max_tokens": 8, **extra})
        assert res.status_code == 200, res.text
        assert res.json()["choices"][0]["token_ids"] == greedy_normal
        _serves_normally(http, greedy_normal)


def test_unknown_routes_and_methods_are_openai_errors(pd):
    with httpx.Client(base_url=pd.base, timeout=30) as http:
        assert _openai_error(http.get("/v1/nothing"), 404)["type"] == "invalid_request_error"
        _openai_error(http.get("/v1/completions"), 405)


def test_chunked_body_over_the_limit_is_413(pd, greedy_normal):
    """No Content-Length: the router counts the bytes as they come and stops at 16 MiB."""
    def chunks():
        yield b'{"prompt": "'
        for _ in range(64):
            yield b"a" * (1 << 20)
        yield b'"}'

    with httpx.Client(base_url=pd.base, timeout=60) as http:
        req = http.build_request("POST", "/v1/completions", content=chunks(),
                                 headers={"content-type": "application/json"})
        assert "content-length" not in req.headers
        try:
            resp = http.send(req)
        except httpx.HTTPError:  # the server may close the connection while we still send
            pass
        else:
            assert _openai_error(resp, 413)["code"] == "body_too_large"
        _serves_normally(http, greedy_normal)


def test_huge_prompt_is_refused_before_tokenizing(pd, greedy_normal):
    """A 15 MB prompt once froze the event loop for ~30 s: now a prompt-size check refuses
    it before the tokenizer sees it, and /health answers meanwhile."""
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        t0 = time.monotonic()
        err = _openai_error(http.post("/v1/completions", json={"prompt": "word " * (3 * 1024 * 1024)}), 400)
        assert "characters" in err["message"]
        assert time.monotonic() - t0 < 10
        _serves_normally(http, greedy_normal)


def test_stream_is_data_events_ending_in_done(pd):
    """(An error after the 200 is an error event before [DONE]: tests/router/test_http_edge.py.)"""
    body = {"prompt": NORMAL_PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.Client(base_url=pd.base, timeout=60) as http, http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)
    assert all("error" not in json.loads(ln[6:]) for ln in lines[:-1])


HOSTILE_ZMQ = [  # (name, sampling) refused with bad_request, naming the field
    ("top_k_2_63", {"top_k": 2**63, "temperature": 1.0}),
    ("max_tokens_2_64_minus_1", {"max_tokens": 2**64 - 1}),
    ("seed_2_63", {"seed": 2**63}),
    ("temperature_inf", {"temperature": float("inf")}),
    ("temperature_nan", {"temperature": float("nan")}),
    ("stop_many", {"stop": ["s"] * 100}),
]


def test_hostile_zmq(pd, raw: RawClient, greedy_normal):
    for name, sampling in HOSTILE_ZMQ:
        rid = raw.submit(sampling, prompt="hi")
        msgs = raw.until_done(rid)
        assert len(msgs) == 1 and msgs[0]["type"] == "error" and msgs[0]["data"]["code"] == "bad_request", (name, msgs)
        assert next(iter(sampling)) in msgs[0]["data"]["message"], (name, msgs)
    rid = raw.submit({"max_tokens": 2}, prompt="x" * (1024 * 1024))
    assert "characters" in raw.until_done(rid)[-1]["data"]["message"]
    for sampling in ({"temperature": 1e-300}, {"temperature": 1.0, "top_p": 1e-300},
                     {"temperature": 1.0, "top_k": 2**31 - 1, "top_p": 1e-300}):
        rid = raw.submit({**sampling, "max_tokens": 8}, prompt=NORMAL_PROMPT)
        msgs = raw.until_done(rid)
        assert msgs[-1]["type"] == "token_output", msgs[-1]
        assert [t for m in msgs for t in m["data"]["token_ids"]] == greedy_normal, sampling
    with httpx.Client(base_url=pd.base, timeout=60) as http:
        _serves_normally(http, greedy_normal)
