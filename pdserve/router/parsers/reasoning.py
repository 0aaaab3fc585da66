"""Reasoning split, as vLLM's `--reasoning-parser`: what a thinking model writes before
`</think>` is `reasoning_content`, the rest `content`. Pure text functions and one
incremental splitter, so a stream's deltas add up to the whole answer's split.

The rules (vLLM's Qwen3 and DeepSeek-R1 parsers): the first `<think>` before `</think>`
is dropped (Qwen3's own template lets the model write it; newer templates put it in the
prompt); an output that never writes `</think>` is all reasoning (cut short while
thinking), except under `qwen3` when the request turned thinking off
(`chat_template_kwargs: {"enable_thinking": false}`, whose prompt already closes an empty
think block): then it is all content. Text before a `<think>` stays reasoning (vLLM's
non-streamed parser drops it; its streamed one keeps it). A chat request's grammar
(response_format, structured_outputs, a forced tool call) applies after `</think>`."""
from __future__ import annotations

import dataclasses

from pdserve.common.sampling_params import StructuredOutput
from pdserve.common.text.detokenizer import held_back_tail
from pdserve.common.text.tokenizer import Tokenizer

START, END = "<think>", "</think>"


def grammar_after_reasoning(so: StructuredOutput | None, tokenizer: Tokenizer, parser: str | None,
                            template_kwargs: dict | None) -> StructuredOutput | None:
    """`so` bound to start after the reasoning (vLLM's structured output with a reasoning
    parser): its `reasoning_end` is the id of `</think>`. Unchanged where there is no
    grammar or no parser, thinking is off (the prompt closed the think block: the grammar
    starts at once) or `</think>` is not one token of the vocabulary."""
    if so is None or parser is None or not thinking_on(parser, template_kwargs):
        return so
    ids = tokenizer.encode(END)
    return dataclasses.replace(so, reasoning_end=ids[0]) if len(ids) == 1 else so


def thinking_on(parser: str, template_kwargs: dict | None) -> bool:
    """False where the parser honours `enable_thinking: false` and the request sets it."""
    return not (parser == "qwen3" and (template_kwargs or {}).get("enable_thinking", True) is False)


class ReasoningSplitter:
    """Owns one output's split state: the text held back (a possible tag's start), whether
    `<think>` was dropped and `</think>` seen. `feed` takes text deltas, `finish` ends the
    output; each returns (reasoning delta, content delta)."""

    def __init__(self, thinking: bool = True) -> None:
        self.thinking = thinking
        self.buf = ""
        self.dropped_start = False
        self.ended = not thinking  # thinking off: everything is content

    def feed(self, delta: str) -> tuple[str, str]:
        if self.ended:
            return "", delta
        buf = self.buf + delta
        end = buf.find(END)
        if not self.dropped_start:
            start = buf.find(START)
            if start >= 0 and (end < 0 or start < end):
                buf = buf[:start] + buf[start + len(START):]
                self.dropped_start = True
                end = buf.find(END)
        if end >= 0:
            self.buf, self.ended = "", True
            return buf[:end], buf[end + len(END):]
        keep = held_back_tail(buf, [END] if self.dropped_start else [START, END])
        self.buf = buf[len(buf) - keep:]
        return buf[:len(buf) - keep], ""

    def finish(self) -> tuple[str, str]:
        """The held-back text: reasoning, as the output never closed its think block."""
        rest, self.buf = self.buf, ""
        return ("", rest) if self.ended else (rest, "")


def split_reasoning(text: str, thinking: bool = True) -> tuple[str | None, str | None]:
    """(reasoning_content, content) of a whole output, None where empty; with thinking
    off, (None, text)."""
    if not thinking:
        return None, text
    s = ReasoningSplitter(thinking)
    r1, c1 = s.feed(text)
    r2, c2 = s.finish()
    return (r1 + r2) or None, (c1 + c2) or None
