"""Incremental detokenization and stop strings, done once per request, in O(new tokens).

The invariant every front end relies on: the deltas of one request, concatenated, equal
the final text, which is `tokenizer.decode(all output tokens, skip_special_tokens=True)`
cut before the first stop string. While a request runs, a delta never ends inside a UTF-8
character (a trailing U+FFFD means the character's bytes have not all arrived) nor in a
tail that could still grow into a stop string.

How (vLLM's prefix/read offsets): only the window `token_ids[prefix_offset:]` is decoded
per token. `read_offset` is where the settled text ends; `prefix_offset` is the previous
read offset, kept as context so decoders that treat a window's first token specially
(metaspace's leading space) decode the new tokens as they read inside the whole. A window
whose text ends in U+FFFD has a character still incomplete: the text before that U+FFFD
run settles, the offsets stay, and the next token widens the window. Every offset is a token boundary where the
decoded bytes end on a whole character, which makes decode(all) the concatenation of the
windows' new text for byte-level (and byte-fallback) decoders.

Why not `tokenizers.decoders.DecodeStream` (same offsets, in Rust): it never yields a text
ending in U+FFFD and exposes neither its buffered ids nor a flush, so the end of a request
whose final text does end in U+FFFD cannot be produced from it; it raises InvalidPrefix
where a window is not prefix-stable; and stop strings need the settled text per token
anyway (which token completed a stop string). Two decodes of a few tokens per token are
cheap (benchmarks/output_path.py).
"""
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
    """Owns one request's output tokens, the text settled from them (and the offsets that
    say where), how much of it was sent, and whether and where a stop string matched.

    `add` is called with each new batch of tokens (any size); after a stop string matched,
    `stopped` is True, `token_ids` ends with the token that completed it and later tokens
    are ignored."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self._window = max((len(s) for s in self.stop), default=1) - 1  # chars a match can reach back
        self.token_ids: list[int] = []
        self.prefix_offset = 0  # token where the decoded window starts (a clean boundary)
        self.read_offset = 0  # token where the settled text ends (a clean boundary)
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._partial = 0  # characters after _prefix_text already settled from an unfinished window
        self._pieces: list[str] = []  # the settled text, in pieces (joined only by `text`)
        self._tail = ""  # the last `_window` characters of the settled text
        self._settled_len = 0  # characters of settled text
        self._unsent = ""  # the settled text after `emitted`: a held-back tail and the newest text
        self.emitted = 0  # characters of text already sent
        self.stopped_at: int | None = None  # where the first stop string begins, once seen
        self.finished = False

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def add(self, token_ids: list[int], finished: bool) -> str:
        """Append tokens (the last ones of the request if `finished`); return the new
        text that is safe to send."""
        if self.stopped_at is not None or self.finished:
            return ""  # text after a stop string is never sent
        for t in token_ids:
            self.token_ids.append(t)
            new = self._settle()
            if new and self._match(new):
                return self._delta(self.stopped_at)
        if finished:
            self.finished = True
            rest = self._flush()
            if rest and self._match(rest):
                return self._delta(self.stopped_at)
            return self._delta(self._settled_len)
        return self._delta(self._settled_len - held_back_tail(self._tail, self.stop))

    @property
    def text(self) -> str:
        """The text so far (settled, cut at a stop string); the final text once finished."""
        text = "".join(self._pieces)
        return text[:self.stopped_at] if self.stopped_at is not None else text

    # ---- internals ----------------------------------------------------------------------
    def _settle(self) -> str:
        """The text the last token settled. A window ending in U+FFFD (a character still
        incomplete) settles what precedes the U+FFFD run and keeps its offsets: the next
        token widens it."""
        text = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        window_new = text[len(self._prefix_text):]
        if text.endswith("\ufffd"):
            stable = window_new.rstrip("\ufffd")
            new = stable[self._partial:]
            self._partial = max(self._partial, len(stable))
        elif not window_new:  # a token with no text (a skipped special token): the context stays
            return ""
        else:
            new = window_new[self._partial:]
            self._partial = 0
            self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
            self._prefix_text = self.tokenizer.decode(self.token_ids[self.prefix_offset:self.read_offset])
        if new:
            self._append(new)
        return new

    def _flush(self) -> str:
        """At the end: whatever is not settled (an incomplete character decodes to U+FFFD,
        as decode(all) has it)."""
        text = self.tokenizer.decode(self.token_ids[self.prefix_offset:])
        new = text[len(self._prefix_text) + self._partial:]
        self._partial = 0
        self.read_offset = len(self.token_ids)
        if new:
            self._append(new)
        return new

    def _append(self, new: str) -> None:
        self._pieces.append(new)
        self._settled_len += len(new)
        self._unsent += new

    def _match(self, new: str) -> bool:
        """Search the stop strings in the held tail plus `new` only: a match ending in
        `new` can start at most `_window` characters before it. Sets `stopped_at` to the
        earliest start; the tail moves on either way."""
        if not self.stop:
            return False
        window = self._tail + new
        start = self._settled_len - len(window)  # where `window` begins in the settled text
        hits = [i for i in (window.find(s) for s in self.stop) if i >= 0]
        self._tail = window[-self._window:] if self._window else ""
        if hits:
            self.stopped_at = start + min(hits)
            return True
        return False

    def _delta(self, end: int) -> str:
        """The settled text from what was sent up to `end` (characters), marked sent."""
        take = end - self.emitted
        if take <= 0:
            return ""
        delta, self._unsent = self._unsent[:take], self._unsent[take:]
        self.emitted = end
        return delta
