"""Incremental detokenization and stop strings, done once per request, in O(new tokens).

The invariant every front end relies on: the deltas of one request, concatenated, equal
the final text, which is `tokenizer.decode(all output tokens, skip_special_tokens)` cut
before the first stop string (after it with `include_stop_str_in_output`). A stop string
counts only once it ends in the text of output token `min_tokens` or later (vLLM's rule:
it is searched in each token's new text and the characters a match can reach back). While a request runs, a delta never ends inside a UTF-8
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
cheap.
"""
from __future__ import annotations

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.text.tokenizer import Tokenizer


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

    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None, *, min_tokens: int = 0,
                 include_stop_str: bool = False, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.min_tokens = min_tokens  # no stop string counts before this many output tokens
        self.include_stop_str = include_stop_str  # the text keeps the stop string that ended it
        self.skip_special_tokens = skip_special_tokens
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
        self.stopped_at: int | None = None  # where the text is cut at the first stop string, once seen
        self.finished = False

    @classmethod
    def for_request(cls, tokenizer: Tokenizer, params: SamplingParams) -> "IncrementalDetokenizer":
        """The detokenizer of a request: its stop strings and text options."""
        return cls(tokenizer, params.stop, min_tokens=params.min_tokens,
                   include_stop_str=params.include_stop_str_in_output,
                   skip_special_tokens=params.skip_special_tokens)

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
        text = self._decode(self.token_ids[self.prefix_offset:])
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
            self._prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        if new:
            self._append(new)
        return new

    def _flush(self) -> str:
        """At the end: whatever is not settled (an incomplete character decodes to U+FFFD,
        as decode(all) has it)."""
        text = self._decode(self.token_ids[self.prefix_offset:])
        new = text[len(self._prefix_text) + self._partial:]
        self._partial = 0
        self.read_offset = len(self.token_ids)
        if new:
            self._append(new)
        return new

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _append(self, new: str) -> None:
        self._pieces.append(new)
        self._settled_len += len(new)
        self._unsent += new

    def _match(self, new: str) -> bool:
        """Search the stop strings in the held tail plus `new` only: a match ending in
        `new` can start at most `_window` characters before it. Sets `stopped_at` to the
        earliest start (the end of that stop string, the first listed of those starting
        there, with `include_stop_str`); the tail moves on either way. Before `min_tokens`
        output tokens nothing matches, and a stop string lying wholly in that text never
        will (only the held tail is searched again)."""
        if not self.stop:
            return False
        held = len(self._tail)
        window = self._tail + new
        start = self._settled_len - len(window)  # where `window` begins in the settled text
        self._tail = window[-self._window:] if self._window else ""
        if len(self.token_ids) < self.min_tokens:
            return False
        # a match must end in `new`: one wholly in the held tail lay in text before min_tokens
        hits = [(i, k) for k, i in enumerate(window.find(s, max(0, held - len(s) + 1)) for s in self.stop) if i >= 0]
        if hits:
            i, k = min(hits)
            self.stopped_at = start + i + (len(self.stop[k]) if self.include_stop_str else 0)
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
