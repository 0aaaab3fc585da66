"""The shape of an OpenAI response around pdserve's outputs: completions' and chat's
objects (`Shape`), a request's echoed prompt (`PromptEcho`) and the envelope that turns a
request's outputs into streamed chunks or one whole answer (`Envelope`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from pdserve.common.wire.messages import TokenOutput
from pdserve.router.openai.chat_output import ChoiceOutput
from pdserve.router.openai.logprobs import TokenText, chat_logprobs, completion_logprobs, prompt_logprobs
from pdserve.router.core.text import openai_usage

ChoiceOutputs = Callable[[], ChoiceOutput]  # a new choice's output shaping (tools, reasoning)


def _chat_logprobs(ids: list[int], lps: list, text: TokenText, offset: int) -> dict:
    return chat_logprobs(ids, lps, text)


def _completion_content(text: str, first: bool | None) -> dict:
    return {"text": text}


def _chat_content(text: str, first: bool | None) -> dict:
    if first is None:  # the whole, non-streamed answer
        return {"message": {"role": "assistant", "content": text}}
    return {"delta": {"role": "assistant", "content": text} if first else {"content": text}}


@dataclass(frozen=True)
class Shape:
    """How one endpoint's responses read: the id prefix, the object names of a whole
    response and of a chunk, and a choice's text part (`content(text, first)`, where
    `first` is None for a whole response and says whether a chunk is the stream's first),
    its logprobs (`logprobs(token_ids, logprobs, token_text, text_offset)`, router/openai/logprobs.py)
    and where vLLM puts `prompt_logprobs` (in each choice, or at the response's top level)."""

    prefix: str
    obj: str
    chunk_obj: str
    content: Callable[[str, bool | None], dict]
    logprobs: Callable[[list[int], list, TokenText, int], dict]
    prompt_logprobs_in_choice: bool


COMPLETION = Shape("cmpl", "text_completion", "text_completion", _completion_content, completion_logprobs, True)
CHAT = Shape("chatcmpl", "chat.completion", "chat.completion.chunk", _chat_content, _chat_logprobs, False)


@dataclass
class PromptEcho:
    """What a response shows of the prompts (one per prompt; choice i * n + j is prompt
    i's choice j): with `echo`, each prompt's text (and its tokens' logprobs, when
    `logprobs` are asked) before each of its choices' own; with `show_logprobs`, vLLM's
    `prompt_logprobs`. The workers send a prompt's logprobs once, with its choice 0; the
    envelope keeps them for the others (`seen`)."""

    texts: list[str]
    token_ids: list[list[int]]
    echo: bool
    logprobs_asked: bool
    show_logprobs: bool
    n: int = 1
    seen: dict[int, list] = field(default_factory=dict)  # prompt -> its logprobs, once they came

    def logprobs_of(self, out: TokenOutput, index: int) -> list | None:
        """The prompt logprobs of choice `index` (from `out`, or from its prompt's choice 0)."""
        if out.prompt_logprobs is not None:
            self.seen[index // self.n] = out.prompt_logprobs
        return self.seen.get(index // self.n)


class Envelope:
    """One response's id, creation time and model, around its choices; for a stream it
    also owns which choices have sent their first chunk (a chat stream's first delta of
    each choice names the role), each choice's text offset for completions' logprobs and,
    for a chat with tools or a reasoning parser (`shaping`), each choice's output state
    (router/openai/chat_output.py)."""

    def __init__(self, shape: Shape, request_id: str, model: str, created: float, token_text: TokenText,
                 prompts: PromptEcho | None = None, shaping: ChoiceOutputs | None = None) -> None:
        self.shape = shape
        self.prompts = prompts  # None: neither echo nor prompt_logprobs
        self.shaping = shaping  # chat with tools or a reasoning parser: each choice's output state
        self.choice_outputs: dict[int, ChoiceOutput] = {}
        self.id = f"{shape.prefix}-{request_id}"
        self.created = int(created)
        self.model = model
        self.started: set[int] = set()
        self.token_text = token_text
        self.offsets: dict[int, int] = {}  # choice -> text offset of its next token (sum of token strings)

    def logprobs(self, out: TokenOutput, index: int, first: bool) -> dict | None:
        """`out`'s logprobs in the endpoint's shape (on a choice's `first` output after the
        echoed prompt's), or None when the request did not ask."""
        ids, lps = out.token_ids, out.logprobs
        p = self.prompts
        if first and p is not None and p.echo and p.logprobs_asked:
            prompt_ids = p.token_ids[index // p.n]
            ids = prompt_ids + ids
            lps = (p.logprobs_of(out, index) or [None] * len(prompt_ids)) + (lps or [])
        if lps is None:
            return None
        form = self.shape.logprobs(ids, lps, self.token_text, self.offsets.get(index, 0))
        self.offsets[index] = self.offsets.get(index, 0) + sum(len(self.token_text(t)) for t in ids)
        return form

    def text(self, out: TokenOutput, index: int, first: bool) -> str:
        """The choice's text of `out`: the prompt's before its first output, with echo."""
        p = self.prompts
        return p.texts[index // p.n] + out.text if first and p is not None and p.echo else out.text

    def prompt_logprobs(self, out: TokenOutput, index: int) -> dict:
        """{"prompt_logprobs": vLLM's form} when the request shows them, else {}."""
        p = self.prompts
        lps = None if p is None or not p.show_logprobs else p.logprobs_of(out, index)
        if lps is None:
            return {}
        return {"prompt_logprobs": prompt_logprobs(p.token_ids[index // p.n], lps, self.token_text)}

    def wrap(self, kind: str, choices: list, usage: dict | None, timeline: dict | None) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices,
                **({"usage": usage} if usage else {}), **({"timeline": timeline} if timeline else {})}

    def chunk(self, out: TokenOutput | None, usage: dict | None = None, index: int = 0) -> dict:
        """A stream's next chunk: `out`'s tokens for choice `index`, or (None) the
        usage-only last chunk."""
        if out is None:
            return self.wrap(self.shape.chunk_obj, [], usage, None)
        first, reason = index not in self.started, out.finish_reason
        if self.shaping is None:
            content = self.shape.content(self.text(out, index, first), first)
        else:
            state = self.choice_outputs.get(index)
            if state is None:
                state = self.choice_outputs[index] = self.shaping()
            delta = state.delta(out.text, out.finished)
            content = {"delta": {"role": "assistant", **delta} if first else delta}
            reason = state.finish_reason(reason) if out.finished else None
        choice = {"index": index, **content, "token_ids": out.token_ids, "logprobs": self.logprobs(out, index, first),
                  "finish_reason": reason}
        self.started.add(index)
        return self.wrap(self.shape.chunk_obj, [choice], usage, out.timeline)

    def whole_choice(self, index: int, res: TokenOutput) -> dict:
        """One choice of a response that was not streamed (`res`: its merged outputs)."""
        if self.shaping is None:
            body, reason = self.shape.content(self.text(res, index, True), None), res.finish_reason
        else:
            state = self.shaping()
            body = {"message": {"role": "assistant", **state.message(res.text)}}
            reason = state.finish_reason(res.finish_reason)
        return {"index": index, **body, "token_ids": res.token_ids, "logprobs": self.logprobs(res, index, True),
                "finish_reason": reason,
                **(self.prompt_logprobs(res, index) if self.shape.prompt_logprobs_in_choice else {})}

    def whole(self, results: list[TokenOutput]) -> dict:
        """The response of a request that was not streamed (`results`: each choice's merged
        outputs, in `index` order)."""
        choices = [self.whole_choice(i, res) for i, res in enumerate(results)]
        timeline = results[0].timeline if len(results) == 1 else None
        whole = self.wrap(self.shape.obj, choices, openai_usage(results), timeline)
        if not self.shape.prompt_logprobs_in_choice:
            whole.update(self.prompt_logprobs(results[0], 0))
        return whole
