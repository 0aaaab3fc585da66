"""Incremental detokenization for streaming. The invariant every front end relies on:
the deltas of one request, concatenated, equal the final text, which is
`tokenizer.decode(all output tokens, skip_special_tokens=True)` cut before the first stop
string. While a request runs, a delta never ends inside a UTF-8 character (a trailing
U+FFFD means the character's bytes have not all arrived) nor in a tail that could still
grow into a stop string."""
from __future__ import annotations

from common.text.tokenizer import Tokenizer


def held_back_tail(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
    longest = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:n]):
                longest = n
                break
    return longest


class IncrementalDetokenizer:
    """Owns one request's output tokens and how much of their text was already sent."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of text already sent
        self.stopped_at: int | None = None  # where the first stop string begins, once seen

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Append tokens; return the new text that is safe to send."""
        self.token_ids.extend(token_ids)
        if self.stopped_at is not None:
            return ""  # text after a stop string is never sent
        # Whole-sequence decode: decoders (byte-level, metaspace) are not all prefix-stable
        # token by token, but decode(all) is the contract; the cost is O(length) per call.
        text = self.tokenizer.decode(self.token_ids)
        # a trailing U+FFFD is a multi-byte character not complete yet: neither sent nor
        # matched against stop strings until it is (it may become another character)
        settled = text if finished else text.rstrip("\ufffd")
        hits = [i for i in (settled.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped_at = end = min(hits)
        elif finished:
            end = len(text)
        else:
            end = len(settled) - held_back_tail(settled, self.stop)
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    @property
    def text(self) -> str:
        text = self.tokenizer.decode(self.token_ids)
        return text[:self.stopped_at] if self.stopped_at is not None else text
