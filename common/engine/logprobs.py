"""Computing `TokenLogprobs` for the rows of a step that ask for them (vLLM's default
logprobs_mode, raw_logprobs: from the model's raw logits, before any processing)."""
from __future__ import annotations

import torch

from common.logprobs import TokenLogprobs
from common.sampling_params import SamplingParams


def raw_logprobs(logits: torch.Tensor, params: list[SamplingParams]) -> tuple[list[int], torch.Tensor] | None:
    """logits [B, V] -> (rows that ask, their float32 log_softmax [R, V]), or None when no
    row asks (one check: a plain step costs nothing more). Taken before sampling, which
    may process the logits."""
    rows = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not rows:
        return None
    return rows, torch.log_softmax(logits[rows].float(), dim=-1)


def token_logprobs(raw: tuple[list[int], torch.Tensor], params: list[SamplingParams],
                   tokens: list[int]) -> dict[int, TokenLogprobs]:
    """{row: its sampled token's logprob and top-n} for the rows of `raw_logprobs`."""
    rows, lp = raw
    k = max(params[i].logprobs or 0 for i in rows)
    chosen = lp.gather(1, torch.tensor([tokens[i] for i in rows], device=lp.device)[:, None])[:, 0].tolist()
    top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k], sorted
    vals, ids = top_vals.tolist(), top_ids.tolist()
    out = {}
    for j, i in enumerate(rows):
        n = params[i].logprobs or 0
        out[i] = TokenLogprobs(chosen[j], ids[j][:n], vals[j][:n])
    return out
