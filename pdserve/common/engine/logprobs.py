"""Computing `TokenLogprobs` for the rows of a step that ask for them (vLLM's default
logprobs_mode, raw_logprobs: from the model's raw logits, before any processing): the
sampled token's, and each prompt token's (SamplingParams.prompt_logprobs)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from pdserve.common.engine.sequence import Sequence
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams


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


PROMPT_ROWS_PER_SLICE = 256  # prompt rows turned into [rows, V] float32 logits at once: bounds memory on a big vocabulary


@dataclass(frozen=True)
class PromptSpan:
    """Rows of a step whose next token is a prompt token of `seq` (it asks for its prompt's
    logprobs): `count` rows from flat row `row`, at positions `start`, start + 1, ..."""

    seq: Sequence
    row: int
    start: int
    count: int


def prompt_spans(seqs: list[Sequence], counts: list[int]) -> list[PromptSpan]:
    """The spans of a step's sequences (in the step's row order) that need prompt
    logprobs; [] for a step without such a sequence. A prompt's last row predicts the
    first output token (sampled, not a prompt logprob), so it is in no span."""
    spans = []
    offset = 0
    for seq, n in zip(seqs, counts):
        if seq.prompt_logprobs is not None:  # asked for and not yet sent
            start = seq.num_computed_tokens
            count = min(start + n, seq.num_prompt_tokens - 1) - start
            if count > 0:
                spans.append(PromptSpan(seq, offset, start, count))
        offset += n
    return spans


def fill_prompt_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                         spans: list[PromptSpan]) -> None:
    """hidden [sum(span.count), H]: the spans' rows in order. Writes each prompt token's
    TokenLogprobs (its logprob and vocabulary rank, and the top-n: n = its request's
    prompt_logprobs) into `seq.prompt_logprobs` at the token's position. Float32
    log_softmax of the raw logits, as `raw_logprobs`."""
    targets, where = [], []
    for sp in spans:
        targets += sp.seq.token_ids[sp.start + 1:sp.start + 1 + sp.count]
        where += [(sp.seq, sp.start + 1 + i) for i in range(sp.count)]
    k = max(sp.seq.sampling_params.prompt_logprobs or 0 for sp in spans)
    target = torch.tensor(targets, device=hidden.device)
    for a in range(0, len(targets), PROMPT_ROWS_PER_SLICE):
        b = min(a + PROMPT_ROWS_PER_SLICE, len(targets))
        lp = torch.log_softmax(compute_logits(hidden[a:b]).float(), dim=-1)  # [R, V]
        chosen = lp.gather(1, target[a:b, None])  # [R, 1]
        ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
        top_vals, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())  # [R, k], sorted
        vals, ids, chosen_l = top_vals.tolist(), top_ids.tolist(), chosen[:, 0].tolist()
        for r in range(b - a):
            seq, pos = where[a + r]
            n = seq.sampling_params.prompt_logprobs or 0
            seq.prompt_logprobs[pos] = TokenLogprobs(chosen_l[r], ids[r][:n], vals[r][:n], ranks[r])
