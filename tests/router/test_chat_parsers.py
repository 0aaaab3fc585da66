"""The reasoning splitter and the Hermes tool-call parser (router/parsers/reasoning.py,
router/parsers/tool_calls.py) on whole outputs and streamed: an output fed in two pieces, cut at
every character, adds up to the whole answer's parse."""
from __future__ import annotations

import json

import pytest

from pdserve.router.parsers.reasoning import ReasoningSplitter, split_reasoning, thinking_on
from pdserve.router.parsers.tool_calls import HermesParser, ToolCall, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def _streamed_reasoning(pieces: list[str], thinking: bool = True) -> tuple[str, str]:
    s = ReasoningSplitter(thinking)
    r, c = zip(*[s.feed(p) for p in pieces], s.finish())
    return "".join(r), "".join(c)


@pytest.mark.parametrize("text, thinking, want", [
    ("<think>abc</think>def", True, ("abc", "def")),
    ("<think>\nabc\n</think>\n\ndef", True, ("\nabc\n", "\n\ndef")),
    ("abc</think>def", True, ("abc", "def")),                 # <think> in the prompt
    ("<think>abc", True, ("abc", None)),                      # cut while thinking: all reasoning
    ("plain words", True, ("plain words", None)),
    ("plain words", False, (None, "plain words")),           # thinking off: all content
    ("<think>abc</think>", True, ("abc", None)),
    ("a</think><think>b", True, ("a", "<think>b")),
    ("x<think>y</think>z", True, ("xy", "z")),
    ("<thi</think>", True, ("<thi", None)),
    ("", True, (None, None)),
])
def test_reasoning_split_whole_and_at_every_cut(text, thinking, want):
    assert split_reasoning(text, thinking) == want
    for cut in range(len(text) + 1):
        r, c = _streamed_reasoning([text[:cut], text[cut:]], thinking)
        assert ((r or None), (c or None)) == (want if thinking else (None, text or None)), cut
    r, c = _streamed_reasoning(list(text), thinking)  # one character at a time
    assert ((r or None), (c or None)) == (want if thinking else (None, text or None))


def test_reasoning_stream_sends_reasoning_before_the_end_tag_arrives():
    s = ReasoningSplitter()
    assert s.feed("<think>step one, ") == ("step one, ", "")
    assert s.feed("step two</th") == ("step two", "")  # "</th" may be the end tag: held back
    assert s.feed("ink>answer") == ("", "answer")
    assert s.feed(" more") == ("", " more")


def test_thinking_on_follows_enable_thinking_for_qwen3_only():
    assert thinking_on("qwen3", None) and thinking_on("qwen3", {"enable_thinking": True})
    assert not thinking_on("qwen3", {"enable_thinking": False})
    assert thinking_on("deepseek_r1", {"enable_thinking": False})


def _calls(calls) -> list[tuple[str, dict | str]]:
    """(name, arguments read as JSON, or as written where they are not whole JSON)."""
    def read(args: str) -> dict | str:
        try:
            return json.loads(args)
        except ValueError:
            return args
    return [(c.name, read(c.arguments)) for c in calls]


def _streamed_tools(pieces: list[str], max_calls: int | None = None) -> tuple[str, list]:
    """The content and calls of a stream, its tool-call deltas summed as the openai SDK's
    stream helper sums them; each call's first delta carries its id, type and name (and
    arguments ""), the later ones only arguments."""
    from openai.lib.streaming._deltas import accumulate_delta
    p = HermesParser(max_calls)
    content, acc = [], {}
    for piece in [*pieces, None]:
        c, deltas = p.feed(piece) if piece is not None else p.finish()
        content.append(c)
        for d in deltas:
            first = d["index"] not in acc
            assert ("id" in d and d["type"] == "function" and "name" in d["function"]) == first, d
            acc[d["index"]] = accumulate_delta(acc.get(d["index"], {}), d)
    calls = [ToolCall(a["id"], a["function"]["name"], a["function"]["arguments"]) for _, a in sorted(acc.items())]
    assert [(c.id, c.name, c.arguments) for c in calls] == [(c.id, c.name, c.arguments) for c in p.calls]
    return "".join(content), calls


WEATHER = ("get_weather", {"city": "Paris", "days": 2})
TIME = ("get_time", {})


@pytest.mark.parametrize("text, content, calls", [
    (CALL, None, [WEATHER]),
    ("Let me check." + CALL, "Let me check.", [WEATHER]),
    (CALL + "\n" + CALL2 + "\n", None, [WEATHER, TIME]),
    ("Sure: " + CALL + " done", "Sure:  done", [WEATHER]),
    ("no calls here", "no calls here", []),
    ("  ", "  ", []),
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>\n{"name": "get_time", "arguments": {}}\n', None, [TIME]),  # closing tag cut off
    ('<tool_call>\n{"name": "get_ti', '<tool_call>\n{"name": "get_ti', []),  # cut inside the JSON
    ("a <tool_ca", "a <tool_ca", []),
    ('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>', None, [("f", {"x": 1})]),
    ('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>', None, [("f", {"a": 1})]),  # read whole
    ('<tool_call>{"name": "f", "parameters": {"s": "} ]</tool_\\"x", "n": [{"k": []}]}}</tool_call>', None,
     [("f", {"s": '} ]</tool_"x', "n": [{"k": []}]})]),
    ('<tool_call>{"name": "f", "arguments": {"a": 1}, "junk": 2}</tool_call>x', "x", [("f", {"a": 1})]),
    (CALL + '<tool_call>{"name": "g", "arguments": {"a": [1, ', None, [WEATHER, ("g", '{"a": [1, ')]),  # cut in its arguments
])
def test_hermes_parse_whole_and_at_every_cut(text, content, calls):
    def same(got_content, got_calls):
        return ((got_content or None) if got_calls else got_content, _calls(got_calls)) == (content, calls)

    whole_content, whole = parse_tool_calls(text)
    assert same(whole_content, whole)
    for pieces in [[text[:cut], text[cut:]] for cut in range(len(text) + 1)] + [list(text)]:
        c, found = _streamed_tools(pieces)
        assert same(c, found), pieces
        assert [(f.name, f.arguments) for f in found] == [(w.name, w.arguments) for w in whole], pieces


def test_hermes_one_call_when_parallel_calls_are_off():
    content, calls = parse_tool_calls(CALL + CALL2, max_calls=1)
    assert content is None and _calls(calls) == [WEATHER]
    assert _calls(_streamed_tools([CALL, CALL2], max_calls=1)[1]) == [WEATHER]


def test_hermes_stream_sends_a_call_when_named_then_its_arguments_as_written():
    p = HermesParser()
    assert p.feed("Checking <tool") == ("Checking ", [])
    assert p.feed('_call>{"name": "get_weather", ') == ("", [])
    content, deltas = p.feed('"arguments": {"city": "Pa')
    call_id = p.calls[0].id
    assert content == "" and call_id.startswith("call_") and deltas == [
        {"index": 0, "id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Pa'}}]
    assert p.feed('ris", "days": 2}') == ("", [{"index": 0, "function": {"arguments": 'ris", "days": 2}'}}])
    assert p.feed("}\n</tool_call>") == ("", [])
    assert p.feed('<tool_call>{"name": "get_time", "arguments": {') == \
        ("", [{"index": 1, "id": p.calls[1].id, "type": "function", "function": {"name": "get_time", "arguments": "{"}}])
    assert p.feed("}</tool_") == ("", [{"index": 1, "function": {"arguments": "}"}}])
    assert [(c.name, c.arguments) for c in p.calls] == [("get_weather", '{"city": "Paris", "days": 2}'),
                                                        ("get_time", "{}")]
