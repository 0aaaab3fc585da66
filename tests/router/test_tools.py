"""Tool requests and chat output shaping without a server (router/openai/tools.py,
router/openai/chat_output.py): tool_choice's forms and their 400 params, the grammars a named or
required choice is enforced with, and one choice's output streamed in pieces adding up to
the whole answer; plus the Qwen3 template `make-model` writes, rendered as transformers
renders it."""
from __future__ import annotations

import json

import pytest
from openai.lib.streaming._deltas import accumulate_delta

from pdserve.common.engine.grammar import check
from pdserve.router.openai.chat_output import ChoiceOutput
from pdserve.router.openai.tools import ToolError, tool_plan, wire_tool_calls

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_tool_choice_defaults_as_vllm():
    assert tool_plan(None, None, None, auto_ready=False) is None
    assert tool_plan([WEATHER], None, None, auto_ready=True).choice == "auto"  # tools given: "auto"
    assert tool_plan([WEATHER], "none", None, auto_ready=False).choice == "none"
    plan = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}}, False, auto_ready=False)
    assert (plan.choice, plan.name, plan.parallel) == ("named", "get_time", False)


@pytest.mark.parametrize("tools, choice, ready, grammar, param", [
    ([WEATHER], None, False, False, "tool_choice"),          # "auto" by default, on a server without a parser
    ([WEATHER], "auto", False, False, "tool_choice"),
    (None, "required", True, False, "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, True, False, "tool_choice"),
    ([WEATHER], {"name": "get_weather"}, True, False, "tool_choice"),
    ([WEATHER], "required", True, True, "tool_choice"),        # beside the request's own grammar
    ([{"type": "function", "function": {"name": "x y"}}], "none", True, False, "tools[0].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}], "none", True, False,
     "tools[1].function.parameters"),
])
def test_bad_tool_requests_name_their_field(tools, choice, ready, grammar, param):
    with pytest.raises(ToolError) as e:
        tool_plan(tools, choice, None, auto_ready=ready, has_grammar=grammar)
    assert e.value.param == param


def test_named_and_required_grammars():
    named = tool_plan([WEATHER, TIME], {"type": "function", "function": {"name": "get_weather"}}, None, True)
    assert json.loads(named.structured().spec) == PARAMS
    required = tool_plan([WEATHER, TIME], "required", False, True).structured()
    schema = json.loads(required.spec)
    assert (schema["type"], schema["minItems"], schema["maxItems"]) == ("array", 1, 1)
    assert [i["properties"]["name"]["enum"] for i in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object", "properties": {}}
    assert "maxItems" not in json.loads(tool_plan([WEATHER], "required", True, True).structured().spec)
    check(named.structured())
    check(required)
    assert tool_plan([WEATHER], "auto", None, True).structured() is None


def test_required_lifts_each_tools_defs_to_the_root():
    point = {"type": "object", "properties": {"at": {"$ref": "#/$defs/P"}}, "required": ["at"],
             "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
    tools = [WEATHER, {"type": "function", "function": {"name": "go", "parameters": point}}]
    schema = json.loads(tool_plan(tools, "required", None, True).structured().spec)
    assert schema["$defs"] == point["$defs"] and "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]
    check(tool_plan(tools, "required", None, True).structured())
    clash = {"type": "function", "function": {"name": "other", "parameters": {**point, "$defs": {"P": {"type": "string"}}}}}
    with pytest.raises(ToolError) as e:
        tool_plan([*tools, clash], "required", None, True)
    assert e.value.param == "tools[2].function.parameters"
    assert tool_plan([*tools, clash], "auto", None, True).choice == "auto"  # only one schema must hold them all


def test_wire_tool_calls_read_arguments_as_vllm():
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
             {"id": "b", "type": "function", "function": {"name": "g", "arguments": ""}},
             {"id": "c", "type": "function", "function": {"name": "h", "arguments": "not json"}}]
    assert [c["function"]["arguments"] for c in wire_tool_calls(calls)] == [{"x": 1}, {}, "not json"]


def _stream(out: ChoiceOutput, text: str, cuts: list[int]) -> tuple[dict, str | None]:
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    got: dict = {"content": "", "reasoning": ""}
    calls: dict[int, dict] = {}
    for i, piece in enumerate(pieces):
        d = out.delta(piece, finished=i == len(pieces) - 1)
        got["content"] += d.get("content") or ""
        got["reasoning"] += d.get("reasoning_content") or ""
        for c in d.get("tool_calls", ()):  # summed as the openai SDK's stream helper sums them
            calls[c["index"]] = accumulate_delta(calls.get(c["index"], {}), c)
    got["calls"] = [(c["function"]["name"], c["function"]["arguments"]) for _, c in sorted(calls.items())]
    return got, out.finish_reason("stop")


def test_auto_with_reasoning_streamed_adds_up_to_the_whole_answer():
    plan = tool_plan([WEATHER], "auto", None, True)
    text = "<think>hmm</think>Let me see." + CALL
    msg = ChoiceOutput(plan, True, True).message(text)
    assert (msg["reasoning_content"], msg["content"]) == ("hmm", "Let me see.")
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_weather", '{"city": "Oslo"}')]
    for cuts in [[cut] for cut in range(len(text) + 1)] + [list(range(1, len(text)))]:
        got, reason = _stream(ChoiceOutput(plan, True, True), text, cuts)
        assert (got["reasoning"], got["content"], got["calls"], reason) == \
            ("hmm", "Let me see.", [("get_weather", '{"city": "Oslo"}')], "tool_calls"), cuts


def test_named_and_required_outputs():
    named = tool_plan([WEATHER], {"type": "function", "function": {"name": "get_weather"}}, None, True)
    out = ChoiceOutput(named, False, True)  # no split: the grammar starts at once
    first, later = out.delta('{"city": ', False), out.delta('"Oslo"}', True)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": '}
    assert later == {"tool_calls": [{"index": 0, "function": {"arguments": '"Oslo"}'}}]}
    assert out.finish_reason("stop") == "stop"
    text = '<think>hm</think>{"city": "Oslo"}'  # the grammar starts after the reasoning
    msg = ChoiceOutput(named, True, True).message(text)
    assert (msg["reasoning_content"], msg["tool_calls"][0]["function"]["arguments"]) == ("hm", '{"city": "Oslo"}')
    for cut in range(len(text) + 1):
        got, reason = _stream(ChoiceOutput(named, True, True), text, [cut])
        assert (got["reasoning"], got["content"], got["calls"], reason) == \
            ("hm", "", [("get_weather", '{"city": "Oslo"}')], "stop"), cut
    required = tool_plan([WEATHER, TIME], "required", None, True)
    text = '[{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    msg = ChoiceOutput(required, False, True).message(text)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == \
        [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')]
    cut = ChoiceOutput(required, False, True)  # cut short by max_tokens: the text, no calls
    assert cut.message(text[:30]) == {"content": text[:30]} and cut.finish_reason("length") == "length"
    got, reason = _stream(ChoiceOutput(required, False, True), text, [10, 40])
    assert got["calls"] == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')] and reason == "tool_calls"
    got, reason = _stream(ChoiceOutput(required, True, True), "<think>x</think>" + text, [5, 20, 60])
    assert got["calls"] == [("get_time", "{}"), ("get_weather", '{"city": "Oslo"}')] and got["reasoning"] == "x"
    msg = ChoiceOutput(required, True, True).message("<think>x</think>" + text)
    assert msg["reasoning_content"] == "x" and len(msg["tool_calls"]) == 2


def test_qwen3_template_renders_tools_as_transformers(tmp_path):
    from transformers import AutoTokenizer

    from pdserve.common.loading.model_factory import make_model
    from pdserve.common.text.tokenizer import Tokenizer
    model = make_model(tmp_path / "q3", "qwen3", "tiny", seed=1, chat_template="qwen3")
    ours, hf = Tokenizer(model), AutoTokenizer.from_pretrained(model)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "reasoning_content": "look it up",
                "tool_calls": wire_tool_calls([{"id": "c1", "type": "function",
                                                "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])},
               {"role": "tool", "tool_call_id": "c1", "content": "snow"}]
    for kwargs in ({}, {"enable_thinking": False}):
        assert ours.apply_chat_template(history, tools=[WEATHER, TIME], template_kwargs=kwargs) == \
            hf.apply_chat_template(history, tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True, **kwargs)
    assert ours.apply_chat_template(history[:2], template_kwargs={"enable_thinking": False}).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = ours.encode("<think>a</think><tool_call>b</tool_call>")
    assert len(ids) == 6 and ours.decode(ids) == "<think>a</think><tool_call>b</tool_call>"  # added, not special
