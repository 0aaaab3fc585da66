"""Prompt-lookup (n-gram) proposals, vLLM's `ngram` method: the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, for the largest n in
[prompt_lookup_min, prompt_lookup_max] that has one. No model runs: it pays where the
output repeats the input (summaries, code edits, quoting) and finds little elsewhere."""
from __future__ import annotations

from array import array

from pdserve.common.engine.sequence import Sequence

_ITEM = array("i").itemsize  # bytes per token id in the search buffer (4)


def lookup(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n
    tokens of `tokens` (the longest n in [min_n, max_n] that occurred), or [].

    The ids become one bytes buffer (4 per id) searched backwards by `bytes.rfind` (C
    speed: ~10 us at a few hundred tokens, where NumPy's window comparison took ~180 us, on
    every decoding sequence at every step); a hit not on a 4-byte boundary is no match."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    buf = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = buf[(length - n) * _ITEM:]
        end = (length - 1) * _ITEM  # a match ends before the last token: one follows it, not the suffix itself
        while (pos := buf.rfind(pattern, 0, end)) >= 0:
            if pos % _ITEM == 0:
                start = pos // _ITEM + n
                return tokens[start:start + num_tokens]
            end = pos + len(pattern) - 1  # the next try starts before this one
    return []


class NgramProposer:
    """Prompt lookup over each sequence's prompt and output; keeps nothing per sequence."""

    free = True

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        return [lookup(s.token_ids, k, self.min_n, self.max_n) for s, k in zip(seqs, num_tokens)]

    def release(self, seq_id: int) -> None:
        pass
