"""`pdserve serve` under bad input: malformed or invalid requests over HTTP and ZeroMQ get
a clear error naming the problem, and streams already running go on undisturbed."""
from __future__ import annotations

import threading
import time

import httpx
import msgpack
import openai
import pytest

from pdserve.common.wire.messages import PROTOCOL_VERSION
from tests.support.serving import MAX_MODEL_LEN, RawClient, serving_pd

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

# 3 ms per decode step: the 400-token streams below last >= 1.2 s, past the bad input sent
# while they run. The tiny model alone decodes 400 tokens in under 0.4 s (the decode
# stack), as fast as the bad input: the stream once ended first (CI).
SLOW_DECODE = "delay_step_ms=3@decode-0"


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    """The package's P/D server, with its decode worker slowed (SLOW_DECODE)."""
    with serving_pd(model_dir, tmp_path_factory.mktemp("serve_pd_slow"), MAX_MODEL_LEN, faults=SLOW_DECODE) as served:
        yield served


@pytest.fixture(scope="module")
def oai(pd) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.http, api_key="unused", max_retries=0, timeout=60)

BAD_HTTP = [  # (name, path, body, text the error message must contain)
    ("malformed_json", "completions", b'{"prompt": "hi", "max_tokens": ', "JSON"),
    ("max_tokens_not_int", "completions", {"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ("max_tokens_zero", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("n_zero", "completions", {"prompt": "hi", "n": 0}, "n must be in [1, 128]"),
    ("prompt_too_long", "completions", {"prompt": [5] * MAX_MODEL_LEN}, "max_model_len"),
    ("negative_temperature", "completions", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("token_outside_vocab", "completions", {"prompt": [1, 10**9]}, "vocabulary"),
    ("missing_prompt", "completions", {"max_tokens": 3}, "prompt"),
    ("chat_bad_role", "chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("chat_no_messages", "chat/completions", {"messages": []}, "messages"),
    ("chat_top_p", "chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_p": 0}, "top_p"),
]


@pytest.mark.parametrize("path,body,needle", [c[1:] for c in BAD_HTTP], ids=[c[0] for c in BAD_HTTP])
def test_http_bad_input_is_a_400_naming_the_problem(pd, path, body, needle):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    resp = httpx.post(f"{pd.http}/{path}", timeout=30, **kw)
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert needle in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_openai_client_sees_bad_request(oai):
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.completions.create(model="qwen3", prompt="hi", temperature=-1)


@pytest.mark.parametrize("path,body", [
    ("completions", {"prompt": "hi", "max_tokens": 0, "stream": True}),
    ("chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1, "stream": True}),
], ids=["completions", "chat"])
def test_http_bad_input_is_a_400_when_streaming_too(pd, path, body):
    """Invalid sampling values are known before any token: a streamed request must get the
    same 400 as a non-streamed one, not a 200 whose event stream carries the error."""
    resp = httpx.post(f"{pd.http}/{path}", json=body, timeout=30)
    assert resp.status_code == 400, f"{resp.status_code}: {resp.text}"
    assert "error" in resp.json()


def _malformed_zmq(raw: RawClient) -> list[tuple[str, object]]:
    """Send undecodable messages; each must get an error with code malformed and id ""."""
    frames = [
        ("not_msgpack", [b"\xc1\xc1 definitely not msgpack"]),
        ("not_a_map", [msgpack.packb([1, "submit", {}])]),
        ("extra_envelope_key", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "abort", "data": {"request_id": "a"}, "x": 1})]),
        ("bad_version", [msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "abort", "data": {"request_id": "a"}})]),
        ("unknown_type", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "summon", "data": {}})]),
        ("unknown_field", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt": "hi", "priority": 3}})]),
        ("unknown_sampling_field", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {"temp": 0}, "prompt": "hi"}})]),
        ("missing_field", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {"request_id": "u", "prompt": "hi"}})]),
        ("max_tokens_str", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {"max_tokens": "x"}, "prompt": "hi"}})]),
        ("prompt_ids_str", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt_token_ids": ["a", "b"]}})]),
        ("stream_int", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt": "hi", "stream": 1}})]),
        ("top_k_float", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {"top_k": 1.5}, "prompt": "hi"}})]),
        ("two_frames", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "abort", "data": {"request_id": "a"}}), b"extra"]),
        ("over_16_mib", [msgpack.packb({"v": PROTOCOL_VERSION, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt": "a" * (16 * 1024 * 1024)}})]),
    ]
    replies = []
    for name, parts in frames:
        raw.sock.send_multipart(parts)
        msg = raw.next_error()
        assert msg["data"]["request_id"] == "", (name, msg)
        replies.append((name, msg["data"]))
    return replies


def test_bad_input_while_a_stream_runs(pd, raw, oai, tok, hf_greedy):
    n_new = 400  # long enough (~1-3 s of decoding) to outlast the bad input below
    zmq_prompt, http_prompt = "The decode worker streams", "A cache block holds"
    zmq_want = hf_greedy(pd.model_dir, tok.encode(zmq_prompt), n_new)
    http_want = hf_greedy(pd.model_dir, tok.encode(http_prompt), n_new)
    assert len(zmq_want) == n_new and len(http_want) == n_new, "pick prompts that do not stop at EOS"

    # a streamed HTTP request in a thread and a streamed ZMQ request on the socket we abuse
    http_tokens: list[int] = []
    http_started, http_done = threading.Event(), threading.Event()

    def http_stream():
        try:
            for chunk in oai.completions.create(model="qwen3", prompt=http_prompt, max_tokens=n_new,
                                                temperature=0, stream=True):
                for c in chunk.choices:
                    http_tokens.extend(c.token_ids)
                http_started.set()
        finally:
            http_started.set()
            http_done.set()

    worker = threading.Thread(target=http_stream, daemon=True)
    worker.start()
    rid = raw.submit({"temperature": 0, "max_tokens": n_new}, prompt=zmq_prompt, return_timeline=True)
    first = raw.recv()
    assert first["data"]["request_id"] == rid and first["type"] == "token_output"
    assert http_started.wait(60)

    bad_input_start = time.time()
    replies = _malformed_zmq(raw)
    for name, data in replies:
        assert data["code"] == "malformed" and data["message"], (name, data)
    assert "unknown message type 'summon'" in dict(replies)["unknown_type"]["message"]
    assert "priority" in dict(replies)["unknown_field"]["message"]
    assert "max_tokens" in dict(replies)["max_tokens_str"]["message"]
    assert "exceeds" in dict(replies)["over_16_mib"]["message"]

    # readable but invalid: the error names the request
    bad = raw.submit({"max_tokens": 0}, prompt="hi")
    invalid = [raw.submit({}, prompt="hi", prompt_token_ids=[1]),
               raw.submit({}, prompt_token_ids=[]),
               raw.submit({"temperature": -1.0}, prompt="hi"),
               raw.submit({}, messages=[{"role": "user"}]),
               raw.submit({"max_tokens": 3}, prompt="dup", request_id=rid)]  # id already in flight
    raw.send("token_output", {"request_id": "r", "token_ids": []})  # a server->client message
    errors = [raw.next_error()["data"] for _ in range(1 + len(invalid) + 1)]
    assert {e["code"] for e in errors} == {"bad_request"}, errors
    assert sorted(e["request_id"] for e in errors) == sorted([bad, *invalid, "r"])
    assert "already in flight" in next(e["message"] for e in errors if e["request_id"] == rid)
    with httpx.Client(base_url=pd.http, timeout=30) as http:
        for path, body, _ in [c[1:] for c in BAD_HTTP]:
            kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, bytes) \
                else {"json": body}
            assert http.post(path, **kw).status_code == 400

    # both streams go on, undisturbed
    bad_input_done = time.time()
    msgs = [first] + raw.until_done(rid)
    assert msgs[-1]["data"]["timeline"]["finish"] > bad_input_done, \
        f"the stream ended before the bad input (sent in {bad_input_done - bad_input_start:.2f} s) was all " \
        "answered: the overlap was not tested"
    assert all(m["type"] == "token_output" for m in msgs), msgs[-1]
    assert [t for m in msgs for t in m["data"]["token_ids"]] == zmq_want
    assert http_done.wait(60)
    assert http_tokens == http_want
    assert httpx.get(f"{pd.base}/health").status_code == 200
