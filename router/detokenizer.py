"""Incremental detokenization for streaming: emit text deltas, hold back an incomplete
UTF-8 character and any tail that could still become a stop string."""
from __future__ import annotations

from common.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Owns one request's output tokens and the text already emitted."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop or []
        self.token_ids: list[int] = []
        self.emitted = 0  # characters of text already sent

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Append tokens; return the new text that is safe to send."""
        self.token_ids.extend(token_ids)
        text = self.tokenizer.decode(self.token_ids)
        if finished:
            cut = [text.find(s) for s in self.stop if s in text]
            end = min(cut) if cut else len(text)
        else:
            end = len(text)
            if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
                end = len(text.rstrip("\ufffd"))
            hold = max((len(s) - 1 for s in self.stop), default=0)
            end = min(end, len(text) - hold)
        delta = text[self.emitted:end] if end > self.emitted else ""
        self.emitted = max(self.emitted, end)
        return delta

    @property
    def text(self) -> str:
        return self.tokenizer.decode(self.token_ids)
