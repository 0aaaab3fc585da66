"""One chat choice's answer as the request's tools and the server's reasoning parser shape
it: `reasoning_content` split out, tool calls read from the text ("auto") or made from
the grammar-bound output (a named or "required" choice), streamed or whole. Streamed:
text goes out as it comes (a possible tag's start held back); an "auto" call goes out
once its name is written, then its arguments as they come (router/parsers/tool_calls.py), a
named call's arguments as they come, "required" calls when the output ends. The
reasoning text is sent as `reasoning_content` and as `reasoning` (newer vLLM's name).
finish_reason as vLLM: "tool_calls" for auto calls found and a "required" answer that
stopped; a named call keeps "stop"."""
from __future__ import annotations

import json

from pdserve.router.parsers.reasoning import ReasoningSplitter, split_reasoning
from pdserve.router.parsers import TOOL_CALL_PARSERS
from pdserve.router.parsers.tool_calls import ToolCall, merged, new_call_id, parse_tool_calls
from pdserve.router.openai.tools import ToolPlan


class ChoiceOutput:
    """Owns one choice's output state: the reasoning splitter (None: no reasoning parser),
    the tool-call parser ("auto"), the text of a "required" answer so far, and the calls
    made; `delta` and `message` give the OpenAI fields."""

    def __init__(self, plan: ToolPlan | None, reasoning: bool, thinking: bool) -> None:
        self.choice = plan.choice if plan is not None else "none"
        self.name = plan.name if plan is not None else None
        self.splitter = ReasoningSplitter(thinking) if reasoning else None
        self.parser = TOOL_CALL_PARSERS["hermes"](None if plan is None or plan.parallel else 1) if self.choice == "auto" else None
        self.text = ""  # a "required" answer, parsed when it ends
        self.calls: list[ToolCall] = []
        self.named_id = ""  # the named call's id once its first delta went out

    # ---- streamed --------------------------------------------------------------------
    def delta(self, text: str, finished: bool) -> dict:
        """The delta fields of a chunk carrying `text` (the last chunk: `finished`)."""
        reasoning, content = self.splitter.feed(text) if self.splitter else ("", text)
        if finished and self.splitter:
            r, c = self.splitter.finish()
            reasoning, content = reasoning + r, content + c
        out: dict = _reasoning(reasoning) if reasoning else {}
        if self.choice == "named":
            return {**out, **self._named_delta(content, finished)}
        if self.choice == "required":
            self.text += content
            return {**out, "content": "", **self._required_calls(len(self.calls))} if finished else out
        if self.parser is None:
            return {**out, "content": content} if content or not out else out
        content, calls = self.parser.feed(content)
        if finished:
            c, more = self.parser.finish()
            content, calls = content + c, merged(calls + more)
        self.calls = self.parser.calls
        if content:
            out["content"] = content
        if calls:
            out["tool_calls"] = calls
        return out

    def _named_delta(self, text: str, finished: bool) -> dict:
        if not text and not (finished and not self.named_id):
            return {}
        if self.named_id:
            return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        self.named_id = new_call_id()
        self.calls.append(ToolCall(self.named_id, self.name or "", ""))
        return {"tool_calls": [{"index": 0, "id": self.named_id, "type": "function",
                                "function": {"name": self.name, "arguments": text}}]}

    def _required_calls(self, first: int) -> dict:
        calls = required_calls(self.text)
        if calls is None:
            return {"content": self.text}
        self.calls = calls
        return {"tool_calls": [c.openai(first + i) for i, c in enumerate(calls)]}

    # ---- whole -----------------------------------------------------------------------
    def message(self, text: str) -> dict:
        """The fields of a whole answer's message (role aside)."""
        reasoning, content = split_reasoning(text, self.splitter.thinking) if self.splitter else (None, text)
        out: dict = _reasoning(reasoning) if self.splitter is not None else {}
        if self.choice == "named":
            self.calls = [ToolCall(new_call_id(), self.name or "", content or "")]
            return {"content": "", "tool_calls": [self.calls[0].openai()], **out}
        if self.choice == "required":
            calls = required_calls(content or "")
            if calls is None:  # cut short by max_tokens: not a whole list of calls
                return {"content": content, **out}
            self.calls = calls
            return {"content": "", "tool_calls": [c.openai() for c in calls], **out}
        if self.parser is not None:
            content, self.calls = parse_tool_calls(content or "", self.parser.max_calls)
            if self.calls:
                out["tool_calls"] = [c.openai() for c in self.calls]
        return {"content": content, **out}

    def finish_reason(self, reason: str | None) -> str | None:
        """The choice's finish_reason once the output ended with `reason`."""
        if self.choice == "auto" and self.calls:
            return "tool_calls"
        if self.choice == "required" and reason == "stop" and self.calls:
            return "tool_calls"
        return reason


def _reasoning(text: str | None) -> dict:
    # `reasoning_content` as vLLM's reasoning parsers have long sent it, and `reasoning`,
    # the name newer vLLM uses: clients read one or the other
    return {"reasoning_content": text, "reasoning": text}


def required_calls(text: str) -> list[ToolCall] | None:
    """The calls of a "required" answer (vLLM's form: a JSON list of {"name",
    "parameters"}), or None when it does not parse (cut short)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list) or not all(isinstance(i, dict) and isinstance(i.get("name"), str) for i in items):
        return None
    return [ToolCall(new_call_id(), i["name"], json.dumps(i.get("parameters", {}), ensure_ascii=False))
            for i in items]
