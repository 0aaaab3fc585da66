"""OpenAI's logprobs shapes from the engine's `TokenLogprobs` (common/logprobs.py): the
chat form (`choices[].logprobs.content[]`) and the legacy completions form (`tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`). Token strings are the tokenizer's
decode of the single id, special tokens kept (as vLLM's `decoded_token`); `bytes` is
that string's UTF-8 (a token that is part of a multi-byte character reads as U+FFFD)."""
from __future__ import annotations

from typing import Callable

from common.logprobs import TokenLogprobs

TokenText = Callable[[int], str]  # token id -> its string


def chat_logprobs(token_ids: list[int], lps: list[TokenLogprobs], text: TokenText) -> dict:
    """{"content": [...]}: per token its string, logprob, bytes and the top-n (most likely first)."""
    def entry(tid: int, lp: float) -> dict:
        s = text(tid)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(t, lp.logprob),
                         "top_logprobs": [entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs)]}
                        for t, lp in zip(token_ids, lps)]}


def completion_logprobs(token_ids: list[int], lps: list[TokenLogprobs], text: TokenText, offset: int) -> dict:
    """The legacy form; `offset` is the first token's text offset (a stream's chunks go on
    from the previous one's end: the sum of the earlier tokens' string lengths). As vLLM and
    OpenAI, a step's `top_logprobs` map holds the top-n and the sampled token (n + 1 entries
    when it is not among them)."""
    tokens, offsets, tops = [], [], []
    for t, lp in zip(token_ids, lps):
        s = text(t)
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        top = {text(i): v for i, v in zip(lp.top_ids, lp.top_logprobs)}
        top.setdefault(s, lp.logprob)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps], "top_logprobs": tops,
            "text_offset": offsets}
