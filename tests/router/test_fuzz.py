"""Property-based fuzz of both client protocols against the running prefill + decode
deployment: HTTP bodies (JSON of any shape, the OpenAI fields with wild values) and ZeroMQ
frames (msgpack envelopes with wild fields). Zero 5xx, every ZeroMQ reply a valid error or
output, and the router and both workers alive afterwards. `max_tokens` stays small when it
is valid, so a case costs milliseconds; PDSERVE_FUZZ_EXAMPLES scales the case count."""
from __future__ import annotations

import json
import os
import uuid

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.common.wire.messages import PROTOCOL_VERSION
from tests.support.serving import RawClient, _alive

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "2500"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                suppress_health_check=list(HealthCheck))

# numbers at the edges of every type the stack uses: float32, int64, uint64, msgpack, JSON
_EDGE_INTS = st.sampled_from([0, 1, -1, 2, 3, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                              2**70, -2**63, -2**64, 10**30])
_EDGE_FLOATS = st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-45, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 100.0, 1e38,
                                3.5e38, 1e308, -1.0, float("inf"), float("-inf"), float("nan")])
_TEXT = st.text(max_size=40) | st.sampled_from(["", "\ud800", "a\udfffb", "\x00", "\u202e", "<|im_end|>", "🙂" * 5])
_SCALAR = st.none() | st.booleans() | _EDGE_INTS | st.integers() | _EDGE_FLOATS | st.floats() | _TEXT
_ANY_JSON = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=4) |
                         st.dictionaries(st.text(max_size=8), inner, max_size=4), max_leaves=12)
_SMALL_MAX = st.integers(1, 3)

_SAMPLING = {  # each field: sensible values mostly, hostile ones often
    "temperature": st.sampled_from([0, 0.7, 1.0]) | _EDGE_FLOATS | _EDGE_INTS | _ANY_JSON,
    "top_p": st.sampled_from([1.0, 0.9]) | _EDGE_FLOATS | _ANY_JSON,
    "top_k": st.sampled_from([-1, 5]) | _EDGE_INTS | _ANY_JSON,
    "seed": st.none() | _EDGE_INTS | _ANY_JSON,
    "stop": st.none() | _TEXT | st.lists(_TEXT, max_size=20) | _ANY_JSON,
    "ignore_eos": st.booleans() | _ANY_JSON,
}


def _body(prompt_key: str, prompt: st.SearchStrategy) -> st.SearchStrategy:
    http_only = {
        "n": st.just(PROTOCOL_VERSION) | _EDGE_INTS, "stream": st.booleans(),
        "model": st.none() | st.just("qwen3") | _TEXT, "logprobs": st.none() | st.booleans() | _EDGE_INTS,
        "echo": st.none() | st.booleans(), "best_of": st.none() | _EDGE_INTS, "stream_options": _ANY_JSON,
        "max_completion_tokens": st.none() | _SMALL_MAX | _EDGE_INTS, "presence_penalty": _EDGE_FLOATS,
        "user": _TEXT, "return_timeline": st.booleans() | _ANY_JSON, "junk": _ANY_JSON,
        "tools": _ANY_JSON, "tool_choice": st.sampled_from(["none", "auto", "required"]) | _ANY_JSON,
    }
    return st.fixed_dictionaries({prompt_key: prompt, "max_tokens": _SMALL_MAX | _EDGE_INTS | _ANY_JSON},
                                 optional={**_SAMPLING, **http_only})


_PROMPT = _TEXT | st.lists(st.integers(-5, 300), max_size=20) | st.lists(_EDGE_INTS, max_size=3) | _ANY_JSON
_MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "wizard"]),
                                            "content": _TEXT}, optional={"name": _TEXT, "extra": _ANY_JSON,
                                                                         "tool_calls": _ANY_JSON}),
                     max_size=3) | _ANY_JSON
_HTTP_CASE = (st.tuples(st.just("completions"), _body("prompt", _PROMPT))
              | st.tuples(st.just("chat/completions"), _body("messages", _MESSAGES))
              | st.tuples(st.sampled_from(["completions", "chat/completions"]), _ANY_JSON))


def _encode(body: object) -> bytes:
    # JSON as a client could send it: lone surrogates as \ud800 escapes, NaN/Infinity literals
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def test_fuzz_http_never_5xx(pd):
    seen: dict[int, int] = {}
    with httpx.Client(base_url=pd.http, timeout=60) as http:
        @FUZZ
        @given(case=_HTTP_CASE)
        def one(case):
            path, body = case
            if isinstance(body, dict) and isinstance(body.get("max_tokens"), int) and 3 < body["max_tokens"] < 2**31:
                body["max_tokens"] = 3  # valid but long: keep it small
            if isinstance(body, dict) and isinstance(body.get("max_completion_tokens"), int) and \
                    3 < body["max_completion_tokens"] < 2**31:
                body["max_completion_tokens"] = 3
            resp = http.post(path, content=_encode(body), headers={"content-type": "application/json"})
            text = resp.read()
            seen[resp.status_code] = seen.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (body, text[:300])
            if resp.status_code != 200:
                err = json.loads(text)["error"]
                assert set(err) == {"message", "type", "param", "code"}, err
            elif resp.headers["content-type"].startswith("text/event-stream"):
                assert text.rstrip().endswith(b"data: [DONE]"), text[-300:]
                assert b'"error"' not in text, text[:300]

        one()
    assert seen.get(200, 0) > EXAMPLES // 50, f"too few valid cases to exercise the workers: {seen}"
    _all_alive(pd)


_SUBMIT = st.fixed_dictionaries(
    {"request_id": st.text(max_size=12) | st.uuids().map(str), "sampling": st.fixed_dictionaries(
        {"max_tokens": _SMALL_MAX | _EDGE_INTS}, optional=_SAMPLING) | _ANY_JSON},
    optional={"prompt": _TEXT | _ANY_JSON, "prompt_token_ids": st.lists(st.integers(-5, 300), max_size=20) | _ANY_JSON,
              "messages": _MESSAGES, "stream": st.booleans() | _ANY_JSON, "return_timeline": st.booleans(),
              "tools": _ANY_JSON, "x": _ANY_JSON})
_FRAME = (st.fixed_dictionaries({"v": st.just(PROTOCOL_VERSION), "type": st.just("submit"), "data": _SUBMIT})
          | st.fixed_dictionaries({"v": st.just(PROTOCOL_VERSION) | _EDGE_INTS, "type": st.sampled_from(
              ["submit", "abort", "token_output", "error", "hello", "kv_ready", "x"]) | _TEXT, "data": _ANY_JSON})
          | _ANY_JSON)


def _pack(obj: object) -> bytes:
    try:
        return msgpack.packb(obj, unicode_errors="surrogatepass")
    except (OverflowError, ValueError, TypeError):  # outside msgpack's ints: send the raw bytes of a str
        return msgpack.packb(repr(obj))


def test_fuzz_zmq_never_kills_anything(pd):
    client = RawClient(pd.zmq)
    try:
        @FUZZ
        @given(frame=_FRAME, extra=st.sampled_from([[], [], [], [b""], [b"x" * 10]]))
        def one(frame, extra):
            if isinstance(frame, dict) and isinstance(frame.get("data"), dict):
                data = frame["data"]
                data["request_id"] = uuid.uuid4().hex if frame.get("type") == "submit" else data.get("request_id")
                sampling = data.get("sampling")
                if isinstance(sampling, dict) and isinstance(sampling.get("max_tokens"), int) and \
                        3 < sampling["max_tokens"] < 2**31:
                    sampling["max_tokens"] = 3
            client.sock.send_multipart([_pack(frame), *extra])
            if extra or not isinstance(frame, dict) or frame.get("type") != "abort":
                # every submit ends in an output or an error; everything else gets an error
                while True:
                    msg = client.recv(timeout_s=60)
                    if msg["type"] == "error":
                        assert msg["data"]["code"] in {"malformed", "bad_request", "overloaded"}, msg
                        break
                    assert msg["type"] == "token_output", msg
                    if msg["data"]["finished"]:
                        break

        one()
    finally:
        client.close()
    _all_alive(pd)


def _all_alive(pd) -> None:
    assert pd.proc.poll() is None, pd.log_tail()
    assert all(_alive(p) for p in pd.worker_pids if p is not None), pd.log_tail()
    assert httpx.get(f"{pd.base}/health", timeout=10).json()["workers"] == {"prefill": 1, "decode": 1, "colocated": 0}
