"""What real OpenAI clients send, through the official openai SDK against `pdserve serve`:
vLLM's defaults (a chat runs to the end of the context, a completion stops at 16),
content parts, several prompts, explicit nulls, unknown and unsupported fields, /tokenize,
/detokenize, /version, cached prompt tokens, and /metrics under vLLM's names. A second
deployment, on a model whose tokenizer adds a BOS and whose template reads
`enable_thinking`, checks the tokenizer options against transformers."""
from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from transformers import AutoTokenizer

from tests.support.helpers import bos_thinking_model
from tests.support.serving import CHAT, MAX_MODEL_LEN, MAX_NEW, PROMPTS, chat_ids, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

LONG = " ".join(PROMPTS) * 2  # several KV blocks: a repeat finds them cached


def test_chat_without_max_tokens_runs_to_the_end_of_the_context(oai, tok):
    res = oai.chat.completions.create(model="qwen3", messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    n_prompt = len(chat_ids(tok, CHAT))
    assert res.usage.prompt_tokens == n_prompt
    assert res.usage.completion_tokens == MAX_MODEL_LEN - n_prompt and res.choices[0].finish_reason == "length"


def test_max_completion_tokens_and_completion_default(oai):
    res = oai.chat.completions.create(model="qwen3", messages=CHAT, temperature=0, max_completion_tokens=5,
                                      extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 5
    res = oai.completions.create(model="qwen3", prompt=PROMPTS[0], temperature=0, extra_body={"ignore_eos": True})
    assert res.usage.completion_tokens == 16  # the legacy completions default, as vLLM


def test_content_parts_are_the_same_text(oai):
    def ask(content):
        msgs = [CHAT[0], {"role": "user", "content": content}]
        return oai.chat.completions.create(model="qwen3", messages=msgs, max_tokens=MAX_NEW, temperature=0)

    parts = ask([{"type": "text", "text": "Which worker"}, {"type": "text", "text": "decodes?"}])
    plain = ask("Which worker\ndecodes?")
    assert parts.choices[0].token_ids == plain.choices[0].token_ids  # type: ignore[attr-defined]
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens


def test_image_parts_are_refused_by_type(oai):
    with pytest.raises(openai.BadRequestError, match="image_url") as e:
        oai.chat.completions.create(model="qwen3", max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "http://x/a.png"}}]}])
    assert e.value.body["param"] == "messages"


@pytest.mark.parametrize("stream", [False, True])
def test_several_prompts_one_choice_each(oai, stream):
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2]]
    single = [oai.completions.create(model="qwen3", prompt=p, max_tokens=MAX_NEW, temperature=0) for p in prompts]
    kw = dict(model="qwen3", prompt=prompts, max_tokens=MAX_NEW, temperature=0)
    if stream:
        ids: dict[int, list[int]] = {}
        text: dict[int, str] = {}
        usage = None
        for chunk in oai.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
            usage = chunk.usage or usage
            for c in chunk.choices:
                ids[c.index] = ids.get(c.index, []) + c.token_ids
                text[c.index] = text.get(c.index, "") + c.text
        got = [(ids[i], text[i]) for i in range(len(prompts))]
    else:
        res = oai.completions.create(**kw)
        assert [c.index for c in res.choices] == [0, 1, 2]
        got = [(c.token_ids, c.text) for c in res.choices]
        usage = res.usage
    assert got == [(s.choices[0].token_ids, s.choices[0].text) for s in single]
    assert usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert usage.completion_tokens == sum(s.usage.completion_tokens for s in single)


def test_explicit_nulls_mean_defaults(pd):
    nulls = {k: None for k in ("max_tokens", "max_completion_tokens", "top_p", "top_k", "stop", "seed", "n",
                               "stream", "stream_options", "logprobs", "echo", "user", "presence_penalty")}
    res = httpx.post(f"{pd.http}/completions", json={"prompt": PROMPTS[0], "temperature": 0, "ignore_eos": True,
                                                     **nulls}, timeout=60)
    assert res.status_code == 200, res.text
    assert res.json()["usage"]["completion_tokens"] == 16
    res = httpx.post(f"{pd.http}/chat/completions", json={"messages": [{**CHAT[1], "name": None}], "max_tokens": 3,
                                                          "temperature": None, **nulls}, timeout=60)
    assert res.status_code == 200, res.text


def test_unknown_field_is_served_and_logged_once(oai, pd):
    for _ in range(2):
        res = oai.completions.create(model="qwen3", prompt="hi", max_tokens=2, extra_body={"frobnicate_level": 3})
        assert res.choices[0].finish_reason in ("length", "stop")
    time.sleep(0.2)
    assert pd.log.read_text(errors="replace").count("'frobnicate_level'") == 1


@pytest.mark.parametrize("field,value", [("best_of", 2),
                                         ("functions", [{"name": "f", "parameters": {}}])])
def test_known_but_unsupported_field_is_refused_by_name(oai, field, value):
    with pytest.raises(openai.BadRequestError, match=field) as e:
        oai.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=2, extra_body={field: value})
    assert e.value.body["param"] == field


def test_tools_auto_needs_a_parser_and_a_named_call_works_on_any_model(oai):
    """This server has no --tool-call-parser and its template takes no tools: "auto" (the
    default with tools) is a 400 naming tool_choice; a named call is made by the grammar."""
    params = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["x"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=20, tools=tools)
    assert e.value.body["param"] == "tool_choice"
    res = oai.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=30, temperature=0, tools=tools,
                                      tool_choice={"type": "function", "function": {"name": "f"}})
    (call,) = res.choices[0].message.tool_calls
    assert call.function.name == "f" and res.choices[0].finish_reason == "stop"
    x = json.loads(call.function.arguments)["x"]
    assert isinstance(x, int) and 0 <= x <= 9


def test_tokenize_detokenize_version(pd, tok):
    hf = AutoTokenizer.from_pretrained(pd.model_dir)
    res = httpx.post(f"{pd.base}/tokenize", json={"prompt": PROMPTS[2]}).json()
    assert res == {"count": len(res["tokens"]), "max_model_len": MAX_MODEL_LEN,
                   "tokens": hf.encode(PROMPTS[2], add_special_tokens=True)}
    chat = httpx.post(f"{pd.base}/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == chat_ids(tok, CHAT)
    bare = httpx.post(f"{pd.base}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()
    assert tok.decode(bare["tokens"], skip_special_tokens=False) == \
        hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    back = httpx.post(f"{pd.base}/detokenize", json={"tokens": chat["tokens"]}).json()
    assert back == {"prompt": tok.decode(chat["tokens"], skip_special_tokens=False)}
    assert back["prompt"] == hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert httpx.post(f"{pd.base}/detokenize", json={"tokens": [10**9]}).status_code == 400
    version = httpx.get(f"{pd.base}/version").json()
    assert set(version) == {"version"} and version["version"][0].isdigit()


@pytest.mark.parametrize("stream", [False, True])
def test_cached_tokens_on_a_repeated_prompt(oai, stream):
    prompt = f"({'Streamed' if stream else 'Whole'}) {LONG}"  # its own first block
    details = []
    for _ in range(2):
        if stream:
            chunks = list(oai.completions.create(model="qwen3", prompt=prompt, max_tokens=2, stream=True,
                                                 stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = oai.completions.create(model="qwen3", prompt=prompt, max_tokens=2).usage
        details.append(usage.prompt_tokens_details.cached_tokens)
    assert details[0] == 0 and details[1] > 0 and details[1] % 16 == 0


def test_vllm_metric_names(oai, pd):
    oai.completions.create(model="qwen3", prompt="metrics", max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    deadline = time.monotonic() + 10
    while True:  # the load gauges come with heartbeats
        fams = {f.name: f for f in text_string_to_metric_families(httpx.get(f"{pd.base}/metrics").text)}
        kv = fams.get("vllm:kv_cache_usage_perc")
        if kv is not None or time.monotonic() > deadline:
            break
        time.sleep(0.2)

    def value(name: str, sample: str) -> float:
        return sum(s.value for s in fams[name].samples if s.name == sample and s.labels["model_name"] == "qwen3")

    for name in ("vllm:time_to_first_token_seconds", "vllm:time_per_output_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"):
        assert fams[name].type == "histogram" and value(name, name + "_count") >= 1, name
    assert value("vllm:prompt_tokens", "vllm:prompt_tokens_total") > 0
    assert value("vllm:generation_tokens", "vllm:generation_tokens_total") >= 3
    assert value("vllm:request_success", "vllm:request_success_total") >= 1
    for gauge in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert fams[gauge].type == "gauge", gauge
    assert 0 <= value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") <= 1
    # the pdserve names are fed by the same observations
    assert fams["pdserve_ttft_seconds"].samples and value("vllm:time_to_first_token_seconds",
                                                          "vllm:time_to_first_token_seconds_count") == \
        sum(s.value for s in fams["pdserve_ttft_seconds"].samples if s.name == "pdserve_ttft_seconds_count")


# ---- a model whose tokenizer adds a BOS and whose template reads enable_thinking ----------

def hf_chat_ids(hf, messages: list[dict], **kw) -> list[int]:
    """What vLLM serves a chat: transformers' rendering, tokenized without special tokens."""
    return hf.encode(hf.apply_chat_template(messages, tokenize=False, **kw), add_special_tokens=False)


@pytest.fixture(scope="module")
def bos(model_dir, tmp_path_factory):
    folder = bos_thinking_model(model_dir, tmp_path_factory.mktemp("bos") / "qwen3")  # served as "qwen3"
    served = start_server(folder, tmp_path_factory.mktemp("serve_bos"), ["--colocated", "1", "--prefill", "0",
                                                                          "--decode", "0"], MAX_MODEL_LEN)
    try:
        yield served, openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=60), \
            AutoTokenizer.from_pretrained(folder)
    finally:
        stop_server(served)


def test_completions_get_the_bos_chats_do_not(bos, hf_greedy):
    served, client, hf = bos
    with_bos = hf.encode(PROMPTS[1], add_special_tokens=True)
    assert with_bos[0] == hf.convert_tokens_to_ids("<|endoftext|>")
    res = client.completions.create(model="qwen3", prompt=PROMPTS[1], max_tokens=MAX_NEW, temperature=0)
    assert res.usage.prompt_tokens == len(with_bos)
    assert res.choices[0].token_ids == hf_greedy(served.model_dir, with_bos, MAX_NEW)
    res = client.completions.create(model="qwen3", prompt=PROMPTS[1], max_tokens=1,
                                    extra_body={"add_special_tokens": False})
    assert res.usage.prompt_tokens == len(with_bos) - 1
    chat = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=1)
    assert chat.usage.prompt_tokens == len(hf_chat_ids(hf, CHAT, add_generation_prompt=True))
    tokens = httpx.post(f"{served.base}/tokenize", json={"prompt": PROMPTS[1]}).json()["tokens"]
    assert tokens == with_bos
    tokens = httpx.post(f"{served.base}/tokenize", json={"prompt": PROMPTS[1], "add_special_tokens": False}).json()
    assert tokens["tokens"] == with_bos[1:]


@pytest.mark.parametrize("thinking", [True, False])
def test_chat_template_kwargs_reach_the_template(bos, thinking):
    served, client, hf = bos
    want = hf_chat_ids(hf, CHAT, add_generation_prompt=True, enable_thinking=thinking)
    res = client.chat.completions.create(model="qwen3", messages=CHAT, max_tokens=1,
                                         extra_body={"chat_template_kwargs": {"enable_thinking": thinking}})
    assert res.usage.prompt_tokens == len(want)
    tokens = httpx.post(f"{served.base}/tokenize", json={"messages": CHAT, "chat_template_kwargs":
                                                         {"enable_thinking": thinking}}).json()["tokens"]
    assert tokens == want


def test_continue_final_message(bos):
    served, client, hf = bos
    msgs = [*CHAT, {"role": "assistant", "content": "The decode worker, which"}]
    want = hf_chat_ids(hf, msgs, continue_final_message=True)
    res = client.chat.completions.create(model="qwen3", messages=msgs, max_tokens=1,
                                         extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert res.usage.prompt_tokens == len(want)
    tokens = httpx.post(f"{served.base}/tokenize", json={"messages": msgs, "continue_final_message": True,
                                                         "add_generation_prompt": False}).json()["tokens"]
    assert tokens == want
    refused = httpx.post(f"{served.http}/chat/completions", json={"messages": msgs, "continue_final_message": True,
                                                                  "add_generation_prompt": True})
    assert refused.status_code == 400 and "cannot both be true" in refused.json()["error"]["message"]


def test_prompt_options_over_zeromq(bos):
    from pdserve.router.client import Client
    served, _, hf = bos
    with_bos = hf.encode(PROMPTS[1], add_special_tokens=True)
    msgs = [*CHAT, {"role": "assistant", "content": "The decode worker, which"}]
    with Client(served.zmq, timeout_s=60) as c:
        assert c.generate(PROMPTS[1], max_tokens=1).num_prompt_tokens == len(with_bos)  # vLLM's default
        assert c.generate(PROMPTS[1], max_tokens=1, add_special_tokens=False).num_prompt_tokens == len(with_bos) - 1
        got = c.generate(messages=CHAT, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
        assert got.num_prompt_tokens == len(hf_chat_ids(hf, CHAT, add_generation_prompt=True, enable_thinking=False))
        got = c.generate(messages=msgs, max_tokens=1, continue_final_message=True)
        assert got.num_prompt_tokens == len(hf_chat_ids(hf, msgs, continue_final_message=True))
        got = c.generate(messages=CHAT, max_tokens=1, add_generation_prompt=False)
        assert got.num_prompt_tokens == len(hf_chat_ids(hf, CHAT, add_generation_prompt=False))
