"""`pdserve serve` over ZeroMQ: a raw pyzmq + msgpack client written from docs/protocol.md
(streamed and one-shot output, chat, prefix cache, stop strings, abort, timelines), the
example client printed in that document, and the Python clients in router/client.py."""
from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time

import httpx
import pytest

from tests.support.reliability_harness import wait_blocks_baseline
from tests.support.serving import CHAT, MAX_NEW, PROMPTS, ROOT, chat_ids, expected_reason

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

PD_TIMELINE = ["arrival", "routed", "decode_arrival", "decode_reserved", "prefill_queued", "prefill_start",
               "prefill_end", "transfer_start", "transfer_end", "kv_ready", "first_token", "finish", "router_done"]
TOKEN_OUTPUT_FIELDS = {"request_id", "token_ids", "text", "finished", "finish_reason", "num_prompt_tokens",
                       "num_cached_tokens", "timeline", "logprobs", "index", "prompt_logprobs"}


# ---- ZeroMQ: a raw client written from docs/protocol.md --------------------------------

def test_raw_zmq_streamed_and_one_shot(raw, pd, tok, hf_greedy):
    prompt = PROMPTS[0]
    ids = tok.encode(prompt)
    want = hf_greedy(pd.model_dir, ids, MAX_NEW)

    rid = raw.submit({"temperature": 0, "max_tokens": MAX_NEW}, prompt=prompt)
    msgs = raw.until_done(rid)
    assert all(m["type"] == "token_output" and set(m["data"]) == TOKEN_OUTPUT_FIELDS for m in msgs), msgs[-1]
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


def test_raw_zmq_long_stream_comes_in_pieces(raw, pd):
    """The router merges the outputs queued behind the one it relays, so 12 tokens that the
    tiny model decodes in ~20 ms may reach a busy router all at once (seen in CI). 300 tokens
    last far longer than any stall of the router: they must come in several messages, and
    add up to what the same request returns in one."""
    sampling = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
    msgs = raw.until_done(raw.submit(sampling, prompt=PROMPTS[1]))
    assert len(msgs) > 1, "not streamed: every token came in one message"
    *head, last = [m["data"] for m in msgs]
    assert all(not d["finished"] and d["finish_reason"] is None for d in head) and last["finished"]
    (one,) = raw.until_done(raw.submit(sampling, prompt=PROMPTS[1], stream=False))
    assert [t for d in (*head, last) for t in d["token_ids"]] == one["data"]["token_ids"]
    assert len(one["data"]["token_ids"]) == 300 and last["finish_reason"] == "length"


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
    # up to and including the token that completed the stop string (a trailing U+FFFD is
    # a character not complete yet), none after it
    n = next(j for j in range(1, len(want) + 1) if stop in tok.decode(want[:j]).rstrip("\ufffd"))
    assert got == want[:n]
    assert not raw.sock.poll(300), "a message arrived after the request ended"
    wait_blocks_baseline(pd, ["prefill-0", "decode-0"])  # the router aborted it on the decode worker: freed


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
    from pdserve.router.client import Client, ServerError
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
    from pdserve.router.client import AsyncClient

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
