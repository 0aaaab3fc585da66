"""The reasoning splitter and the Hermes tool-call parser (router/reasoning.py,
router/tool_parsers.py) on whole outputs and streamed: an output fed in two pieces, cut at
every character, adds up to the whole answer's parse."""
from __future__ import annotations

import json

import pytest

from router.reasoning import ReasoningSplitter, split_reasoning, thinking_on
from router.tool_parsers import HermesParser, parse_tool_calls

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


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed_tools(pieces: list[str], max_calls: int | None = None) -> tuple[str, list]:
    p = HermesParser(max_calls)
    content, calls = [], []
    for piece in pieces:
        c, found = p.feed(piece)
        content.append(c)
        calls += found
    c, found = p.finish()
    return "".join(content) + c, calls + found


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
])
def test_hermes_parse_whole_and_at_every_cut(text, content, calls):
    got_content, got_calls = parse_tool_calls(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    for cut in range(len(text) + 1):
        c, found = _streamed_tools([text[:cut], text[cut:]])
        assert ((c or None) if found else c, _calls(found)) == (content, calls), cut
    c, found = _streamed_tools(list(text))
    assert ((c or None) if found else c, _calls(found)) == (content, calls)


def test_hermes_one_call_when_parallel_calls_are_off():
    content, calls = parse_tool_calls(CALL + CALL2, max_calls=1)
    assert content is None and _calls(calls) == [WEATHER]
    assert _calls(_streamed_tools([CALL, CALL2], max_calls=1)[1]) == [WEATHER]


def test_hermes_stream_sends_text_at_once_and_a_call_when_it_closes():
    p = HermesParser()
    assert p.feed("Checking <tool") == ("Checking ", [])
    assert p.feed('_call>{"name": "get_time", ') == ("", [])
    content, calls = p.feed('"arguments": {}}</tool_call>')
    assert content == "" and _calls(calls) == [TIME] and calls[0].id.startswith("call_")
    assert calls[0].openai(0) == {"index": 0, "id": calls[0].id, "type": "function",
                                  "function": {"name": "get_time", "arguments": "{}"}}
