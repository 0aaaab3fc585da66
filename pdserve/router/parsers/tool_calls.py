"""Tool calls in a model's own output, as vLLM's `--tool-call-parser`: `hermes` reads the
Hermes / Qwen2.5 / Qwen3 form, a JSON object per call between `<tool_call>` and
`</tool_call>`:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One incremental parser, so a stream's deltas add up to the whole answer's parse. A call
streams as OpenAI's do: once a block has written `{"name": "...", "arguments": {` the call
goes out (index, id, type, name, arguments ""), then its arguments as the model writes
them, up to the `}` that closes them; what follows them up to `</tool_call>` is dropped.
A call's `arguments` are the model's own text of the object, streamed or not; a block
cut short inside them keeps what was written. A block of another shape (keys in another
order, arguments as a JSON string) is read whole when it closes, its arguments
re-serialized; one whose JSON does not parse (or names no function) stays in the content
as text. Text outside the blocks is the content (None when calls were found and it is
only whitespace). vLLM differs in three corners: it keeps only the text before the first
call, falls back to no calls at all when any block fails to parse, and re-serializes the
arguments of a whole answer."""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from pdserve.common.text.detokenizer import held_back_tail

START, END = "<tool_call>", "</tool_call>"
# a block's start once its call can stream: the name (a JSON string), then the arguments' first character
HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*(\S)')


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


class _ArgsScan:
    """Where a streamed call's arguments object stands: nesting depth and string state;
    `done` once its closing `}` went by."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_str = False
        self.esc = False
        self.done = False

    def take(self, text: str) -> int:
        """How much of `text` belongs to the arguments (all of it until they close)."""
        for n, ch in enumerate(text, 1):
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif ch == "\\":
                    self.esc = True
                elif ch == '"':
                    self.in_str = False
            elif ch == '"':
                self.in_str = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return n
        return len(text)


class HermesParser:
    """Owns one output's tool-call parse state: the text held back (a possible tag's start
    or an open block's unsettled text), the open block's mode ("head": its call not yet
    known; "args": its arguments streaming; "whole": read when it closes), whether content
    has begun (leading whitespace waits until it does) and the calls found. `feed` takes
    text deltas, `finish` ends the output; each returns (content delta, OpenAI tool_calls
    deltas). `max_calls` (parallel_tool_calls false: 1) drops the calls after that many."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.buf = ""
        self.in_call = False
        self.mode = "head"
        self.scan = _ArgsScan()
        self.scanned = 0  # how much of a head/whole block's text is known to hold no END
        self.found: list[list[str]] = []  # [id, name, arguments] of each call sent
        self.live = False  # the streaming call is sent (not one beyond max_calls)
        self.pending_space = ""  # whitespace-only content not yet sent
        self.started = False

    @property
    def calls(self) -> list[ToolCall]:
        return [ToolCall(*c) for c in self.found]

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        self.buf += delta
        text: list[str] = []
        out: list[dict] = []
        while self._step(text, out):
            pass
        return self._content("".join(text)), merged(out)

    def finish(self) -> tuple[str, list[dict]]:
        """The rest: an open block's streaming call ends with what its arguments got; a
        block read whole is a call when its JSON is complete (the closing tag was cut
        off), else text."""
        out: list[dict] = []
        rest, self.buf = self.buf, ""
        text = rest
        if self.in_call:
            text = self._close(rest, out, closed=False)
        self.in_call = False
        content = self._content(text)
        if not self.started and not self.found:  # no calls: whitespace-only content is the content
            content, self.pending_space = self.pending_space + content, ""
        return content, merged(out)

    def _step(self, text: list[str], out: list[dict]) -> bool:
        """Moves the parse on over the held text; False once it needs more."""
        if not self.in_call:
            at = self.buf.find(START)
            if at < 0:
                keep = held_back_tail(self.buf, [START])
                text.append(self.buf[:len(self.buf) - keep])
                self.buf = self.buf[len(self.buf) - keep:]
                return False
            text.append(self.buf[:at])
            self.buf, self.in_call, self.mode, self.scanned = self.buf[at + len(START):], True, "head", 0
            return True
        end = self.buf.find(END, self.scanned if self.mode in ("head", "whole") else 0)
        if self.mode == "head" and self._head(end, out):
            return True
        if end >= 0:
            body, self.buf, self.in_call, self.scanned = self.buf[:end], self.buf[end + len(END):], False, 0
            text.append(self._close(body, out, closed=True))
            return True
        if self.mode in ("head", "whole"):  # the next search starts where END could still begin
            self.scanned = max(0, len(self.buf) - len(END) + 1)
        else:
            settled = len(self.buf) - held_back_tail(self.buf, [END])
            self._args(self.buf[:settled], out)
            self.buf = self.buf[settled:]
        return False

    def _head(self, end: int, out: list[dict]) -> bool:
        """Opens the block's call once its name and the `{` of its arguments are in (before
        any END); the mode becomes "whole" where the block has another shape."""
        m = HEAD.match(self.buf, 0, end if end >= 0 else len(self.buf))
        if m is None:
            return False
        try:
            name = json.loads(m.group(1))
        except ValueError:
            name = ""
        if m.group(2) != "{" or not name:
            self.mode = "whole"
            return False
        self.mode, self.scan, self.buf = "args", _ArgsScan(), self.buf[m.start(2):]
        self.live = self.max_calls is None or len(self.found) < self.max_calls
        if self.live:
            self.found.append([new_call_id(), name, ""])
            out.append({"index": len(self.found) - 1, "id": self.found[-1][0], "type": "function",
                        "function": {"name": name, "arguments": ""}})
        return True

    def _args(self, text: str, out: list[dict]) -> None:
        """The streaming call's arguments text so far, sent up to where they close."""
        if self.scan.done or not text:
            return
        piece = text[:self.scan.take(text)]
        if self.live:
            self.found[-1][2] += piece
            out.append({"index": len(self.found) - 1, "function": {"arguments": piece}})

    def _close(self, body: str, out: list[dict], closed: bool) -> str:
        """An ended block's text in the content: "" for a call (or one beyond max_calls)."""
        if self.mode == "args":
            self._args(body, out)
            return ""
        call = parse_call(body)
        if call is None:
            return START + body + (END if closed else "")
        if self.max_calls is None or len(self.found) < self.max_calls:
            self.found.append([call.id, call.name, call.arguments])
            out.append(call.openai(len(self.found) - 1))
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


def merged(deltas: list[dict]) -> list[dict]:
    """Tool-call deltas with each run of one index's pieces joined into one."""
    out: list[dict] = []
    for d in deltas:
        if out and out[-1]["index"] == d["index"]:
            fn = out[-1]["function"]
            out[-1] = {**out[-1], "function": {**fn, "arguments": fn.get("arguments", "") + d["function"]["arguments"]}}
        else:
            out.append(d)
    return out


def parse_tool_calls(text: str, max_calls: int | None = None) -> tuple[str | None, list[ToolCall]]:
    """(content, calls) of a whole output; content is None where calls were found and
    nothing but whitespace is left."""
    p = HermesParser(max_calls)
    c1, _ = p.feed(text)
    c2, _ = p.finish()
    content = c1 + c2
    return (content or None) if p.found else content, p.calls
