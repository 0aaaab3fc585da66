"""`pdserve serve` over HTTP, driven by the official openai client: completions and chat,
one-shot and streamed, match transformers' greedy `generate`; /models, /health and
/metrics report the prefill + decode deployment."""
from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.serving import CHAT, MAX_MODEL_LEN, MAX_NEW, PROMPTS, chat_ids, expected_reason

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

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
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (len(tok.encode(prompt)), len(want))


def test_completions_long_stream_comes_in_chunks(oai, pd):
    """12 tokens may reach a busy router at once and go out as one chunk (the relay merges
    what is queued); 300 must come in several, adding up to the same request unstreamed."""
    kw = dict(model="qwen3", prompt=PROMPTS[0], max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
    chunks = [c for chunk in oai.completions.create(stream=True, **kw) for c in chunk.choices]
    assert len(chunks) >= 2, "not streamed: all tokens came in one chunk"
    assert [c.finish_reason for c in chunks[:-1]] == [None] * (len(chunks) - 1) and chunks[-1].finish_reason == "length"
    one = oai.completions.create(**kw).choices[0]
    assert [t for c in chunks for t in c.token_ids] == one.token_ids and len(one.token_ids) == 300


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
    body = health.json()
    pools = body.pop("pools")
    assert body == {"status": "ok", "workers": {"prefill": 1, "decode": 1, "colocated": 0}, "dead": [], "failed": []}
    assert {w: (p["role"], p["state"]) for w, p in pools.items()} == {"prefill-0": ("prefill", "serving"),
                                                                      "decode-0": ("decode", "serving")}

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
