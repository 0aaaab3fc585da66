"""Tools and reasoning through `pdserve serve`, driven by the official openai client, on a
random model whose chat template is Qwen3's own (`make-model --chat-template qwen3`),
served with vLLM's flags (--enable-auto-tool-choice --tool-call-parser hermes
--reasoning-parser qwen3), colocated and 1P+1D: a named or required tool_choice gives
calls whose arguments validate against the tool's schema (the grammar writes them, so a
random model does), after the model's reasoning (the grammar starts after `</think>`) or
at once with thinking off; "auto" and the reasoning split read an output the test forces:
the model reasons a few tokens, a bias on `</think>` ends that, then a structured_outputs
regex writes the rest; streamed calls come as OpenAI's fragments and add up (the openai
SDK's stream helper) to the whole answer's; tool messages render; bad tools are a 400
naming the field; tools travel on the ZeroMQ wire and into /tokenize."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pytest

from pdserve.common.text.tokenizer import Tokenizer
from tests.support.serving import RawClient, openai_client, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3")
ROLES = {"colocated": ["--colocated", "1", "--prefill", "0", "--decode", "0"], "pd": ["--prefill", "1", "--decode", "1"]}
OFF = {"chat_template_kwargs": {"enable_thinking": False}}  # the grammar of a forced call starts at once
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    from pdserve.common.loading.model_factory import make_model
    return str(make_model(tmp_path_factory.mktemp("qwen3_tools"), "qwen3", "tiny", seed=1, chat_template="qwen3"))


@pytest.fixture(scope="module", params=list(ROLES))
def served(request, tools_model, tmp_path_factory):
    s = start_server(tools_model, tmp_path_factory.mktemp(f"serve_tools_{request.param}"), ROLES[request.param], 1536,
                     extra=FLAGS)
    try:
        yield s
    finally:
        stop_server(s)


@pytest.fixture(scope="module")
def client(served) -> openai.OpenAI:
    return openai_client(served)


def _chat(client, stream: bool = False, **kw):
    kw.setdefault("messages", ASK)
    kw.setdefault("max_tokens", 120)
    return client.chat.completions.create(model=client.models.list().data[0].id, stream=stream, **kw)


def _streamed(chunks) -> dict:
    """A stream's deltas put together: content, reasoning, tool calls (by index), finish_reason."""
    out: dict = {"content": "", "reasoning": "", "calls": {}, "finish_reason": None}
    for chunk in chunks:
        for c in chunk.choices:
            out["content"] += c.delta.content or ""
            out["reasoning"] += getattr(c.delta, "reasoning_content", None) or ""
            for tc in c.delta.tool_calls or ():
                call = out["calls"].setdefault(tc.index, {"name": "", "arguments": "", "id": None})
                call["id"] = tc.id or call["id"]
                call["name"] += tc.function.name or "" if tc.function else ""
                call["arguments"] += tc.function.arguments or "" if tc.function else ""
            out["finish_reason"] = c.finish_reason or out["finish_reason"]
    return out


def test_named_tool_choice_gives_arguments_that_validate(client):
    """(With thinking off: the grammar starts at once; after reasoning, see below.)"""
    named = {"type": "function", "function": {"name": "get_weather"}}
    for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 5}):
        res = _chat(client, tools=TOOLS, tool_choice=named, extra_body=OFF, **kw)
        choice = res.choices[0]
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather" and call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])
        assert choice.finish_reason == "stop"  # as vLLM and OpenAI: a named call stops
    whole = _chat(client, tools=TOOLS, tool_choice=named, extra_body=OFF, temperature=0).choices[0].message.tool_calls[0]
    got = _streamed(_chat(client, stream=True, tools=TOOLS, tool_choice=named, extra_body=OFF, temperature=0))
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
        [("get_weather", whole.function.arguments)]
    assert got["finish_reason"] == "stop" and got["calls"][0]["id"].startswith("call_")


def test_required_tool_choice_gives_calls_of_the_tools(client):
    for parallel in (True, False):
        res = _chat(client, tools=TOOLS, tool_choice="required", extra_body=OFF, temperature=1.0, seed=3, max_tokens=200,
                    parallel_tool_calls=parallel)
        choice = res.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        assert choice.message.tool_calls and (parallel or len(choice.message.tool_calls) == 1)
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    whole = _chat(client, tools=TOOLS, tool_choice="required", extra_body=OFF, temperature=0, max_tokens=200).choices[0]
    got = _streamed(_chat(client, stream=True, tools=TOOLS, tool_choice="required", extra_body=OFF, temperature=0, max_tokens=200))
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert got["finish_reason"] == whole.finish_reason == "tool_calls"


def _forced(text: str) -> dict:
    """extra_body that makes the model write exactly `text` (a regex of it) once its grammar applies."""
    return {"structured_outputs": {"regex": re.escape(text)}}


@pytest.fixture(scope="module")
def thinks_then(tools_model):
    """thinks_then(text): the kwargs that make the random model reason a few tokens of its
    own, end its reasoning (a bias on `</think>`), then write exactly `text` (the grammar
    applies after the reasoning)."""
    think_end = Tokenizer(tools_model).encode("</think>")
    assert len(think_end) == 1
    return lambda text: {"temperature": 1.0, "seed": 4, "logit_bias": {str(think_end[0]): 6},
                         "extra_body": _forced(text)}


def test_auto_reads_the_calls_the_model_writes_after_its_reasoning(client, thinks_then):
    kw = thinks_then("I will check." + CALL_TEXT)
    res = _chat(client, tools=TOOLS, **kw)
    msg = res.choices[0].message
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
    assert calls == [("get_weather", {"city": "Paris", "days": 2})]
    assert (msg.content, res.choices[0].finish_reason) == ("I will check.", "tool_calls")
    assert msg.reasoning_content and "</think>" not in msg.reasoning_content
    got = _streamed(_chat(client, stream=True, tools=TOOLS, **kw))
    assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
        [(c.function.name, c.function.arguments) for c in msg.tool_calls]
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (msg.reasoning_content, msg.content,
                                                                       "tool_calls")


def test_auto_streams_each_call_in_fragments_that_add_up_to_the_whole_answer(client, thinks_then):
    second = CALL_TEXT.replace('"city": "Paris", "days": 2', '"city": "Rome", "days": 7')
    kw = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, **thinks_then(CALL_TEXT + "\n" + second)}
    whole = _chat(client, **kw).choices[0]
    model = client.models.list().data[0].id
    with client.chat.completions.stream(model=model, **kw) as stream:  # the openai SDK sums the deltas
        deltas = [c.delta.tool_calls for e in stream if e.type == "chunk" for c in e.chunk.choices
                  if c.delta.tool_calls]
        final = stream.get_final_completion().choices[0]
    assert [(c.function.name, json.loads(c.function.arguments)) for c in final.message.tool_calls] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("get_weather", {"city": "Rome", "days": 7})]
    assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert final.finish_reason == whole.finish_reason == "tool_calls"
    assert final.message.reasoning_content == whole.message.reasoning_content
    pieces = [d for ds in deltas for d in ds]
    heads = [d for d in pieces if d.id is not None]
    assert [(d.index, d.function.name, d.type) for d in heads] == [(0, "get_weather", "function"),
                                                                    (1, "get_weather", "function")]
    assert len({d.id for d in heads}) == 2
    assert all(d.function.name is None for d in pieces if d.id is None)  # later deltas: arguments only
    assert len([d for d in pieces if d.index == 0]) > 2  # the arguments came in several deltas


def test_auto_without_thinking_and_without_calls(client):
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    res = _chat(client, tools=TOOLS, temperature=0, extra_body={**_forced(CALL_TEXT + CALL_TEXT), **off},
                parallel_tool_calls=False, max_tokens=400)
    msg = res.choices[0].message
    assert [c.function.name for c in msg.tool_calls] == ["get_weather"]  # one call: parallel calls are off
    assert msg.content is None and msg.reasoning_content is None and res.choices[0].finish_reason == "tool_calls"
    res = _chat(client, tools=TOOLS, temperature=0, extra_body={**_forced("No tool needed."), **off})
    assert res.choices[0].message.content == "No tool needed." and not res.choices[0].message.tool_calls
    assert res.choices[0].finish_reason == "stop"


def test_reasoning_split_without_tools(client, thinks_then):
    kw = thinks_then("def")
    msg = _chat(client, **kw).choices[0]
    assert msg.message.reasoning_content and (msg.message.content, msg.finish_reason) == ("def", "stop")
    got = _streamed(_chat(client, stream=True, **kw))
    assert (got["reasoning"], got["content"], got["finish_reason"]) == (msg.message.reasoning_content, "def", "stop")
    # cut while thinking: all reasoning, as vLLM's qwen3 parser (and the grammar never began)
    msg = _chat(client, temperature=0, max_tokens=3, extra_body=_forced("one two three four five")).choices[0]
    assert msg.finish_reason == "length" and msg.message.content is None and msg.message.reasoning_content
    assert not msg.message.reasoning_content.startswith("one")


NAMED = {"type": "function", "function": {"name": "get_weather"}}
FORCED = [({"tools": TOOLS, "tool_choice": NAMED}, "stop"), ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False}, "tool_calls"),
          ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMAS["get_weather"]}}},
           "stop")]


def _answer(res, stream: bool) -> tuple[str | None, list[tuple[str, dict]], object, str]:
    """(reasoning, calls (name, arguments), the content read as JSON, finish_reason) of an answer."""
    if stream:
        got = _streamed(res)
        calls = [(c["name"], json.loads(c["arguments"])) for c in got["calls"].values()]
        return got["reasoning"] or None, calls, json.loads(got["content"] or "null"), got["finish_reason"]
    choice = res.choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or ()]
    return (getattr(choice.message, "reasoning_content", None), calls, json.loads(choice.message.content or "null"),
            choice.finish_reason)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_or_json_follows_the_reasoning(client, tools_model, stream):
    think_end = Tokenizer(tools_model).encode("</think>")
    bias = {str(think_end[0]): 6}  # the random model ends its reasoning after a few tokens
    for seed, (kw, finish) in enumerate(FORCED):
        res = _chat(client, stream=stream, temperature=1.0, seed=seed, logit_bias=bias, max_tokens=300, **kw)
        reasoning, calls, content, reason = _answer(res, stream)
        assert reasoning and reason == finish, (kw, reasoning, calls, content)
        if "tools" not in kw:
            calls = [("get_weather", content)]
        assert calls and all(n in SCHEMAS for n, _ in calls), (kw, calls)
        for name, args in calls:
            jsonschema.validate(args, SCHEMAS[name])


@pytest.mark.parametrize("stream", [False, True])
def test_with_thinking_off_the_grammar_starts_at_once(client, tools_model, stream):
    bias = {str(Tokenizer(tools_model).encode("</think>")[0]): 6}
    for seed, (kw, finish) in enumerate(FORCED):
        res = _chat(client, stream=stream, temperature=1.0, seed=seed, logit_bias=bias, max_tokens=300,
                    extra_body=OFF, **kw)
        reasoning, calls, content, reason = _answer(res, stream)
        assert reasoning is None and reason == finish, (kw, reasoning, calls, content)
        for name, args in calls or [("get_weather", content)]:
            jsonschema.validate(args, SCHEMAS[name])


def test_tool_messages_render_and_are_answered(client):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]
    res = _chat(client, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=5)
    assert res.choices[0].finish_reason in ("stop", "length") and not res.choices[0].message.tool_calls


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function"}]}, "tools.0.function"),
    ({"tools": [{**WEATHER, "function": {**WEATHER["function"], "name": "bad name!"}}]}, "tools[0].function.name"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_tools_are_a_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        _chat(client, **fields)
    assert e.value.status_code == 400 and e.value.body["param"] == param, e.value.body


def test_tools_travel_on_the_zeromq_wire(served, tools_model):
    tok = Tokenizer(tools_model)
    want = len(tok.encode(tok.apply_chat_template(ASK, tools=TOOLS)))
    raw = RawClient(served.zmq)
    try:
        rid = raw.submit({"max_tokens": 2, "temperature": 0}, messages=ASK, tools=TOOLS)
        last = raw.until_done(rid)[-1]
    finally:
        raw.close()
    assert last["type"] == "token_output" and last["data"]["num_prompt_tokens"] == want
    tokenized = httpx.post(f"{served.base}/tokenize", json={"messages": ASK, "tools": TOOLS}).json()
    assert tokenized["tokens"] == tok.encode(tok.apply_chat_template(ASK, tools=TOOLS))  # vLLM's /tokenize takes tools
    assert want > len(tok.encode(tok.apply_chat_template(ASK))) + 50  # the tools are in the prompt
