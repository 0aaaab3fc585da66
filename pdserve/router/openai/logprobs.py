"""OpenAI's logprobs shapes from the engine's `TokenLogprobs` (common/logprobs.py): the
chat form (`choices[].logprobs.content[]`) and the legacy completions form (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`). Token strings are the tokenizer's
decode of the single id, special tokens kept (as vLLM's `decoded_token`); `bytes` is
that string's UTF-8 (a token that is part of a multi-byte character reads as U+FFFD)."""
from __future__ import annotations

from typing import Callable

from pdserve.common.logprobs import TokenLogprobs

TokenText = Callable[[int], str]  # token id -> its string


def chat_logprobs(token_ids: list[int], lps: list[TokenLogprobs], text: TokenText) -> dict:
    """{"content": [...]}: per token its string, logprob, bytes and the top-n (most likely first)."""
    def entry(tid: int, lp: float) -> dict:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(token_ids, lps)]}


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], text: TokenText,
                        offset: int) -> dict:
    """The legacy form; `offset` is the first token's text offset (a stream's chunks go on
    from the previous one's end: the sum of the earlier tokens' string lengths). As vLLM and
    OpenAI, a step's `top_logprobs` map holds the top-n and the sampled token (n + 1 entries
    when it is not among them). An echoed prompt's tokens come first; its first token has
    no logprob (None in `token_logprobs` and `top_logprobs`)."""
    tokens, offsets, tops = [], [], []
    for t, lp in zip(token_ids, lps):
        s = text(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            tops.append(None)
            continue
        top = {text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(s, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": tops, "text_offset": offsets}


def prompt_logprobs(token_ids: list[int], lps: list[TokenLogprobs | None], text: TokenText) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} holding the prompt token (its rank in the vocabulary, 1 = most
    likely) and the top-n (ranks 1..n)."""
    out: list[dict | None] = []
    for t, lp in zip(token_ids, lps):
        if lp is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(t)}}
        for r, (i, v) in enumerate(zip(lp.top_ids, lp.top_logprobs), 1):
            entry.setdefault(str(i), {"logprob": v, "rank": r, "decoded_token": text(i)})
        out.append(entry)
    return out
