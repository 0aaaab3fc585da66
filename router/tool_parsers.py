"""Tool calls in a model's own output, as vLLM's `--tool-call-parser`: `hermes` reads the
Hermes / Qwen2.5 / Qwen3 form, a JSON object per call between `<tool_call>` and
`</tool_call>`:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Pure text functions and one incremental parser, so a stream's deltas add up to the whole
answer's parse. A block whose JSON does not parse (or names no function) stays in the
content as text; text outside the blocks is the content (None when calls were found and
it is only whitespace). vLLM differs in two corners: it keeps only the text before the
first call, and falls back to no calls at all when any block fails to parse."""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from common.text.detokenizer import held_back_tail

START, END = "<tool_call>", "</tool_call>"
TOOL_CALL_PARSERS = ("hermes",)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One function call: `arguments` is JSON text, as OpenAI's `tool_calls` carry it."""

    id: str
    name: str
    arguments: str

    def openai(self, index: int | None = None) -> dict:
        """The OpenAI form: a message's `tool_calls` entry, or (with `index`) a whole call
        as one stream delta."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def parse_call(body: str) -> ToolCall | None:
    """The call one block's JSON names, or None when it is not {"name": str, "arguments": ...}."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(new_call_id(), obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Owns one output's tool-call parse state: the text held back (a possible tag's start
    or an open block), whether content has begun (leading whitespace waits until it does)
    and how many calls were found. `feed` takes text deltas, `finish` ends the output;
    each returns (content delta, new complete calls). `max_calls` (parallel_tool_calls
    false: 1) drops the blocks after that many calls."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buf = ""
        self.in_call = False
        self.scanned = 0  # how much of an open block's text is known to hold no END
        self.calls = 0
        self.pending_space = ""  # whitespace-only content not yet sent
        self.started = False

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buf += delta
        text: list[str] = []
        found: list[ToolCall] = []
        while True:
            if not self.in_call:
                at = self.buf.find(START)
                if at < 0:
                    keep = held_back_tail(self.buf, [START])
                    text.append(self.buf[:len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep:]
                    break
                text.append(self.buf[:at])
                self.buf, self.in_call = self.buf[at + len(START):], True
            else:
                at = self.buf.find(END, self.scanned)
                if at < 0:  # an open block: the next search starts where END could still begin
                    self.scanned = max(0, len(self.buf) - len(END) + 1)
                    break
                self.scanned = 0
                body, self.buf, self.in_call = self.buf[:at], self.buf[at + len(END):], False
                text.append(self._block(body, found, closed=True))
        return self._content("".join(text)), found

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The rest: an open block is a call when its JSON is complete (the closing tag was
        cut off), else text."""
        found: list[ToolCall] = []
        rest, self.buf = self.buf, ""
        text = self._block(rest, found, closed=False) if self.in_call else rest
        self.in_call = False
        content = self._content(text)
        if not self.started and not self.calls:  # no calls: whitespace-only content is the content
            content, self.pending_space = self.pending_space + content, ""
        return content, found

    def _block(self, body: str, found: list[ToolCall], closed: bool) -> str:
        """A block's text in the content ("" when it is a call, or one beyond max_calls)."""
        call = parse_call(body)
        if call is None:
            return START + body + (END if closed else "")
        if self.max_calls is None or self.calls < self.max_calls:
            found.append(call)
        self.calls += 1
        return ""

    def _content(self, text: str) -> str:
        if self.started:
            return text
        if not text.strip():
            self.pending_space += text
            return ""
        self.started = True
        text, self.pending_space = self.pending_space + text, ""
        return text


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content is None where calls were found and
    nothing but whitespace is left."""
    p = HermesParser(max_calls)
    c1, calls = p.feed(text)
    c2, more = p.finish()
    content = c1 + c2
    calls = calls + more
    return (content or None) if calls else content, calls
