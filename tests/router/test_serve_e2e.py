"""`pdserve serve` end to end: real router + worker processes, driven through the official
openai client, a raw pyzmq + msgpack client written from docs/protocol.md, and the Python
clients in router/client.py. Greedy output must equal transformers' `generate`; bad input
must get a clear error while valid requests go on; stopping leaves no process behind."""
from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import msgpack
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.tokenizer import Tokenizer
from tests.router.serving import ROOT, RawClient, check_ready_file_workers, start_server, stop_server

MAX_MODEL_LEN = 512
MAX_NEW = 12
PROMPTS = ["The router sends each request to", "Hello, my name is",
           "A prefill worker computes the prompt and the decode worker streams tokens back to the client "
           "through the router, which measures latency and throughput for every request in the queue"]
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Which worker decodes?"}]
PD_TIMELINE = ["arrival", "routed", "decode_arrival", "decode_reserved", "prefill_queued", "prefill_start",
               "prefill_end", "transfer_start", "transfer_end", "kv_ready", "first_token", "finish", "router_done"]
COLOCATED_TIMELINE = ["arrival", "routed", "decode_arrival", "prefill_queued", "prefill_start", "prefill_end",
                      "first_token", "finish", "router_done"]


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """The transformers oracle runs in this process next to 2+ workers on 2 shared cores."""
    from tests.helpers import one_torch_thread
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


@pytest.fixture(scope="module")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="module")
def pd(model_dir, tmp_path_factory):
    """One prefill + one decode worker behind the router; stopped with SIGTERM."""
    served = start_server(model_dir, tmp_path_factory.mktemp("serve_pd"), ["--prefill", "1", "--decode", "1"],
                          MAX_MODEL_LEN)
    try:
        check_ready_file_workers(served, {"prefill-0": "prefill", "decode-0": "decode"})
        yield served
    finally:
        stop_server(served, signal.SIGTERM)


@pytest.fixture(scope="module")
def oai(pd) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.http, api_key="unused", max_retries=0, timeout=60)


def chat_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages))


def expected_reason(tokens: list[int], max_new: int) -> str:
    return "length" if len(tokens) == max_new else "stop"


# ---- a raw client from docs/protocol.md: pyzmq + msgpack only --------------------------
@pytest.fixture
def raw(pd):
    client = RawClient(pd.zmq)
    yield client
    client.close()


TOKEN_OUTPUT_FIELDS = {"request_id", "token_ids", "text", "finished", "finish_reason", "num_prompt_tokens",
                       "num_cached_tokens", "timeline"}


# ---- HTTP: the official openai client ---------------------------------------------------

def test_completions_greedy_match_transformers(oai, pd, tok, hf_greedy):
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        want = hf_greedy(pd.model_dir, ids, MAX_NEW)
        res = oai.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
        choice = res.choices[0]
        assert choice.token_ids == want, f"prompt {prompt!r}"
        assert choice.text == tok.decode(want)
        assert choice.finish_reason == expected_reason(want, MAX_NEW)
        assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == \
               (len(ids), len(want), len(ids) + len(want))


def test_completions_with_token_id_prompt(oai, pd, hf_greedy):
    ids = list(range(40, 90))
    res = oai.completions.create(model="qwen3", prompt=ids, max_tokens=MAX_NEW, temperature=0)
    assert res.choices[0].token_ids == hf_greedy(pd.model_dir, ids, MAX_NEW)
    assert res.usage.prompt_tokens == len(ids)


def test_completions_streamed(oai, pd, tok, hf_greedy):
    prompt = PROMPTS[2]
    want = hf_greedy(pd.model_dir, tok.encode(prompt), MAX_NEW)
    stream = oai.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0, stream=True,
                                    stream_options={"include_usage": True})
    ids, text, reasons, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            ids += c.token_ids
            text.append(c.text)
            reasons.append(c.finish_reason)
    assert ids == want
    assert "".join(text) == tok.decode(want)
    assert reasons[-1] == expected_reason(want, MAX_NEW) and set(reasons[:-1]) <= {None}
    assert len(reasons) >= 2, "not streamed: all tokens came in one chunk"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(tok.encode(prompt)), len(want))


def test_chat_completions(oai, pd, tok, hf_greedy):
    ids = chat_ids(tok, CHAT)
    want = hf_greedy(pd.model_dir, ids, MAX_NEW)
    res = oai.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0)
    choice = res.choices[0]
    assert choice.token_ids == want
    assert choice.message.role == "assistant" and choice.message.content == tok.decode(want)
    assert choice.finish_reason == expected_reason(want, MAX_NEW)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens, res.usage.total_tokens) == \
           (len(ids), len(want), len(ids) + len(want))


def test_chat_completions_streamed(oai, pd, tok, hf_greedy):
    messages = [{"role": "user", "content": "Describe the prefix cache of a decode worker."}]
    ids = chat_ids(tok, messages)
    want = hf_greedy(pd.model_dir, ids, MAX_NEW)
    stream = oai.chat.completions.create(model="qwen3", messages=messages, max_tokens=MAX_NEW, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    got, text, roles, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            got += c.token_ids
            text.append(c.delta.content or "")
            roles.append(c.delta.role)
    assert got == want
    assert "".join(text) == tok.decode(want)
    assert roles[0] == "assistant"
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == \
           (len(ids), len(want), len(ids) + len(want))


def test_longest_allowed_prompt_gets_one_token(oai, pd, hf_greedy):
    ids = [(7 * i) % 2000 + 3 for i in range(MAX_MODEL_LEN - 1)]
    res = oai.completions.create(model="qwen3", prompt=ids, max_tokens=MAX_NEW, temperature=0)
    assert res.choices[0].token_ids == hf_greedy(pd.model_dir, ids, 1)
    assert res.choices[0].finish_reason == "length"


def test_models_health_metrics(oai, pd):
    models = oai.models.list().data
    assert [m.id for m in models] == ["qwen3"]
    assert httpx.get(f"{pd.http}/models").json()["data"][0]["max_model_len"] == MAX_MODEL_LEN
    health = httpx.get(f"{pd.base}/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "workers": {"prefill": 1, "decode": 1, "colocated": 0}}

    oai.completions.create(model="qwen3", prompt="metrics", max_tokens=3, temperature=0)
    deadline = time.monotonic() + 10
    while True:  # per-worker gauges come with heartbeats (every 0.5 s)
        resp = httpx.get(f"{pd.base}/metrics")
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
        fams = {f.name: f for f in text_string_to_metric_families(resp.text)}
        kv = {s.labels["worker_id"]: s.value for s in fams["pdserve_worker_kv_transfer_bytes"].samples} \
            if "pdserve_worker_kv_transfer_bytes" in fams else {}
        if kv.get("prefill-0", 0) > 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    requests = {s.labels["outcome"]: s.value for s in fams["pdserve_requests"].samples if s.name == "pdserve_requests_total"}
    assert sum(requests.values()) >= 1 and requests.get("length", 0) >= 1
    for gauge in ("pdserve_worker_waiting", "pdserve_worker_running", "pdserve_worker_free_blocks",
                  "pdserve_worker_total_blocks", "pdserve_worker_prefix_cache_hit_rate"):
        assert fams[gauge].type == "gauge"
        assert {(s.labels["worker_id"], s.labels["role"]) for s in fams[gauge].samples} == \
               {("prefill-0", "prefill"), ("decode-0", "decode")}, gauge
    assert {s.value for s in fams["pdserve_worker_total_blocks"].samples} == {256}
    assert kv.get("prefill-0", 0) > 0, "no KV transfer bytes reported by the prefill worker"
    assert fams["pdserve_ttft_seconds"].type == "histogram"
    assert fams["pdserve_output_tokens"].samples[0].value >= 3


# ---- ZeroMQ: a raw client written from docs/protocol.md --------------------------------

def test_raw_zmq_streamed_and_one_shot(raw, pd, tok, hf_greedy):
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    want = hf_greedy(pd.model_dir, ids, MAX_NEW)

    rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW}, prompt=prompt)
    msgs = raw.until_done(rid)
    assert all(m["type"] == "token_output" and set(m["data"]) == TOKEN_OUTPUT_FIELDS for m in msgs), msgs[-1]
    assert len(msgs) > 1, "not streamed: every token came in one message"
    assert [t for m in msgs for t in m["data"]["token_ids"]] == want
    assert "".join(m["data"]["text"] for m in msgs) == tok.decode(want)
    *head, last = [m["data"] for m in msgs]
    assert all(not d["finished"] and d["finish_reason"] is None and d["timeline"] is None for d in head)
    assert last["finished"] and last["finish_reason"] == expected_reason(want, MAX_NEW)
    assert last["num_prompt_tokens"] == len(ids) and last["timeline"] is None

    rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW}, prompt=prompt, stream=False)
    (one,) = raw.until_done(rid)
    d = one["data"]
    assert one["type"] == "token_output" and set(d) == TOKEN_OUTPUT_FIELDS
    assert d["token_ids"] == want and d["text"] == tok.decode(want) and d["finished"]
    assert d["num_prompt_tokens"] == len(ids) and d["finish_reason"] == expected_reason(want, MAX_NEW)


def test_raw_zmq_chat_token_ids_and_prefix_cache(raw, pd, tok, hf_greedy):
    rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW}, messages=CHAT, stream=False)
    (msg,) = raw.until_done(rid)
    assert msg["data"]["token_ids"] == hf_greedy(pd.model_dir, chat_ids(tok, CHAT), MAX_NEW)

    base = list(range(300, 340))  # 40 tokens: two full blocks can be cached
    for prompt in (base, base + [5, 6, 7]):
        rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW}, prompt_token_ids=prompt, stream=False)
        (msg,) = raw.until_done(rid)
        assert msg["type"] == "token_output", msg
        assert msg["data"]["token_ids"] == hf_greedy(pd.model_dir, prompt, MAX_NEW)
    assert msg["data"]["num_cached_tokens"] == 32, "the decode worker did not reuse its cached prefix"


def test_raw_zmq_stop_string(raw, pd, tok, hf_greedy):
    ids = tok.encode(PROMPTS[1])
    want = hf_greedy(pd.model_dir, ids, MAX_NEW)
    full = tok.decode(want)
    stop = full[len(full) // 2:len(full) // 2 + 2]
    assert stop.strip(), f"greedy text {full!r} has no usable stop string"
    rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW, "stop": [stop]}, prompt_token_ids=ids)
    msgs = [m["data"] for m in raw.until_done(rid)]
    text = "".join(d["text"] for d in msgs)
    assert msgs[-1]["finish_reason"] == "stop"
    assert text == full[:full.find(stop)]
    got = [t for d in msgs for t in d["token_ids"]]
    assert got == want[:len(got)] and stop in tok.decode(got)


def test_raw_zmq_abort(raw, pd):
    rid = raw.submit({"temperature": 0, "max_tokens": 400, "ignore_eos": True}, prompt="abort me")
    first = raw.recv()
    assert first["type"] == "token_output" and first["data"]["request_id"] == rid
    raw.send("abort", {"request_id": rid})
    msgs = raw.until_done(rid)
    assert msgs[-1]["type"] == "error", "an aborted request must end with an error"
    assert msgs[-1]["data"] == {"request_id": rid, "message": "aborted by client", "code": "aborted"}
    assert len(msgs) < 300, "the abort did not stop generation"
    assert not raw.sock.poll(300), "a message arrived after the request ended"
    raw.send("abort", {"request_id": "never-submitted"})  # ignored without a reply
    assert not raw.sock.poll(300)
    rid = raw.submit({"temperature": 0, "max_tokens": 2}, prompt="still works", stream=False)
    assert raw.until_done(rid)[-1]["type"] == "token_output"


def test_timeline_keys_in_order(raw, pd):
    rid = raw.submit({"temperature": 0, "max_tokens": 4}, prompt=PROMPTS[2], return_timeline=True)
    msgs = raw.until_done(rid)
    assert all(m["data"]["timeline"] is None for m in msgs[:-1])
    timeline = msgs[-1]["data"]["timeline"]
    assert list(timeline) == PD_TIMELINE
    times = list(timeline.values())
    assert times == sorted(times), timeline
    assert timeline["first_token"] == timeline["kv_ready"]
    assert abs(timeline["arrival"] - time.time()) < 60, "timeline values are Unix times in seconds"

    res = httpx.post(f"{pd.http}/completions", json={"prompt": "x", "max_tokens": 2, "return_timeline": True},
                     timeout=60).json()
    assert list(res["timeline"]) == PD_TIMELINE


def test_doc_example_client_runs(pd, tok, hf_greedy):
    """The example in docs/protocol.md, as printed there, gets the greedy tokens."""
    doc = (ROOT / "docs" / "protocol.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", doc, flags=re.S)
    imported = set(re.findall(r"^(?:import|from) (\w+)", code, flags=re.M))
    assert imported <= {"sys", "uuid", "msgpack", "zmq"}, f"the example may use only zmq + msgpack: {imported}"
    out = subprocess.run([sys.executable, "-c", code, pd.zmq], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    ids, text = eval(out.stdout.strip().splitlines()[-1])  # the example prints (ids, text)
    assert ids == hf_greedy(pd.model_dir, tok.encode("Hello, my name is"), 16)
    assert text == tok.decode(ids)


# ---- router/client.py -----------------------------------------------------------------

def test_python_client(pd, tok, hf_greedy):
    from router.client import Client, ServerError
    with Client(pd.zmq, timeout_s=60) as client:
        done = client.generate(PROMPTS[1], max_tokens=MAX_NEW, temperature=0, return_timeline=True)
        want = hf_greedy(pd.model_dir, tok.encode(PROMPTS[1]), MAX_NEW)
        assert done.token_ids == want and done.text == tok.decode(want)
        assert done.num_prompt_tokens == len(tok.encode(PROMPTS[1])) and len(done.token_times) == len(want)
        assert list(done.timeline) == PD_TIMELINE
        outs = list(client.stream(messages=CHAT, max_tokens=MAX_NEW, temperature=0))
        assert [t for o in outs for t in o.token_ids] == hf_greedy(pd.model_dir, chat_ids(tok, CHAT), MAX_NEW)
        assert outs[-1].finished and not any(o.finished for o in outs[:-1])
        with pytest.raises(ServerError, match="max_tokens") as err:
            client.generate("x", max_tokens=0)
        assert err.value.code == "bad_request"
        # leaving a stream early aborts it; the client is still usable afterwards
        for _ in client.stream("abandon", max_tokens=300, ignore_eos=True, temperature=0):
            break
        assert client.generate(PROMPTS[0], max_tokens=MAX_NEW, temperature=0).token_ids == \
               hf_greedy(pd.model_dir, tok.encode(PROMPTS[0]), MAX_NEW)


def test_async_client_many_in_flight(pd, tok, hf_greedy):
    from router.client import AsyncClient

    async def run():
        async with AsyncClient(pd.zmq) as client:
            return await asyncio.wait_for(asyncio.gather(
                *(client.generate(p, max_tokens=MAX_NEW, temperature=0) for p in PROMPTS),
                client.generate(messages=CHAT, max_tokens=MAX_NEW, temperature=0)), 60)

    results = asyncio.run(run())
    wants = [hf_greedy(pd.model_dir, tok.encode(p), MAX_NEW) for p in PROMPTS]
    wants.append(hf_greedy(pd.model_dir, chat_ids(tok, CHAT), MAX_NEW))
    assert [r.token_ids for r in results] == wants
    assert len({r.request_id for r in results}) == len(results)


# ---- bad input --------------------------------------------------------------------------

BAD_HTTP = [  # (name, path, body, text the error message must contain)
    ("malformed_json", "completions", b'{"prompt": "hi", "max_tokens": ', "JSON"),
    ("max_tokens_not_int", "completions", {"prompt": "hi", "max_tokens": "x"}, "max_tokens"),
    ("max_tokens_zero", "completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("n_2", "completions", {"prompt": "hi", "n": 2}, "n=2"),
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
        ("extra_envelope_key", [msgpack.packb({"v": 1, "type": "abort", "data": {"request_id": "a"}, "x": 1})]),
        ("bad_version", [msgpack.packb({"v": 2, "type": "abort", "data": {"request_id": "a"}})]),
        ("unknown_type", [msgpack.packb({"v": 1, "type": "summon", "data": {}})]),
        ("unknown_field", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt": "hi", "priority": 3}})]),
        ("unknown_sampling_field", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {"temp": 0}, "prompt": "hi"}})]),
        ("missing_field", [msgpack.packb({"v": 1, "type": "submit", "data": {"request_id": "u", "prompt": "hi"}})]),
        ("max_tokens_str", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {"max_tokens": "x"}, "prompt": "hi"}})]),
        ("prompt_ids_str", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt_token_ids": ["a", "b"]}})]),
        ("stream_int", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {}, "prompt": "hi", "stream": 1}})]),
        ("top_k_float", [msgpack.packb({"v": 1, "type": "submit", "data": {
            "request_id": "u", "sampling": {"top_k": 1.5}, "prompt": "hi"}})]),
        ("two_frames", [msgpack.packb({"v": 1, "type": "abort", "data": {"request_id": "a"}}), b"extra"]),
        ("over_16_mib", [msgpack.packb({"v": 1, "type": "submit", "data": {
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


# ---- colocated, and SIGINT --------------------------------------------------------------

def test_colocated_flag_alone_is_accepted(model_dir, monkeypatch):
    """`pdserve serve --colocated 2` (as DESIGN.md and --help spell it) must start two
    colocated workers. The CLI is run up to the point where it would start serving."""
    import router.serve
    from common.cli import main
    started = []
    monkeypatch.setattr(router.serve, "run", lambda config, dep, ready_file="": started.append(dep))
    rc = main(["serve", model_dir, "--colocated", "2", "--http-port", "0", "--zmq-port", "0",
               "--num-kv-blocks", "256", "--max-model-len", str(MAX_MODEL_LEN), "--num-threads", "1"])
    assert rc == 0 and len(started) == 1, "`--colocated 2` was rejected (see stderr)"
    dep = started[0]
    assert (dep.colocated_devices, dep.prefill_devices, dep.decode_devices) == (("cpu", "cpu"), (), ())


def test_colocated_serves_greedy_and_stops_on_sigint(model_dir, tok, hf_greedy, tmp_path):
    from router.client import Client
    # `--prefill 0 --decode 0`: without them the CLI rejects `--colocated` alone, because
    # --prefill and --decode default to 1 (test_colocated_flag_alone_is_accepted)
    served = start_server(model_dir, tmp_path, ["--colocated", "2", "--prefill", "0", "--decode", "0"], MAX_MODEL_LEN)
    try:
        health = httpx.get(f"{served.base}/health").json()
        assert health["workers"] == {"prefill": 0, "decode": 0, "colocated": 2}
        client = openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=60)
        for prompt in PROMPTS:
            want = hf_greedy(model_dir, tok.encode(prompt), MAX_NEW)
            res = client.completions.create(model="qwen3", prompt=prompt, max_tokens=MAX_NEW, temperature=0)
            assert res.choices[0].token_ids == want
        want = hf_greedy(model_dir, chat_ids(tok, CHAT), MAX_NEW)
        chunks = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=MAX_NEW, temperature=0,
                                                stream=True)
        assert [t for ch in chunks for c in ch.choices for t in c.token_ids] == want
        with Client(served.zmq, timeout_s=60) as zc:
            done = zc.generate(PROMPTS[2], max_tokens=MAX_NEW, temperature=0, return_timeline=True)
        assert done.token_ids == hf_greedy(model_dir, tok.encode(PROMPTS[2]), MAX_NEW)
        assert list(done.timeline) == COLOCATED_TIMELINE
        times = list(done.timeline.values())
        assert times == sorted(times)
    except BaseException:
        with contextlib.suppress(Exception):  # still stop it when the test fails; report the first failure
            stop_server(served, signal.SIGTERM)
        raise
    stop_server(served, signal.SIGINT)
    check_ready_file_workers(served, {"colocated-0": "colocated", "colocated-1": "colocated"})
