"""Prompt-lookup (n-gram) proposals, vLLM's `ngram` method: the tokens that followed the
latest earlier occurrence of the sequence's last n tokens, for the largest n in
[prompt_lookup_min, prompt_lookup_max] that has one. No model runs: it pays where the
output repeats the input (summaries, code edits, quoting) and finds little elsewhere."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pdserve.common.engine.sequence import Sequence


def lookup(tokens: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the last n
    tokens of `tokens` (the longest n in [min_n, max_n] that occurred), or []."""
    length = len(tokens)
    if length < min_n + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - 1 - n: each followed by at least one token, the
        # suffix itself (starting at length - n) not among them
        windows = sliding_window_view(arr[:length - 1], n)  # [length - n, n], a view
        hits = np.flatnonzero((windows == arr[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return arr[start:start + num_tokens].tolist()
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
