"""Verifying draft tokens against the target model in one step: the rejection sampler of
speculative decoding (Leviathan et al. 2023, Chen et al. 2023).

A verified sequence brings 1 + k rows of the target's logits: row i is what the target
predicts after the sequence's last token and its first i draft tokens (the runner computes
each row as a decode step at that position would: model_runner.ModelRunner.as_rows). Each
row is processed as the sampler processes any row (the grammar's mask, logit bias,
min_tokens, penalties; over the row's own history: the sequence, then the drafts before
it), then:

- greedy: drafts are kept while each equals its row's argmax; the row after the last kept
  one gives the next token. Every kept token is the one greedy decoding would have chosen
  at that position, so the output is the output without speculation.
- random: the proposers are deterministic (a draft token d has draft probability 1), so
  d is kept with probability p(d) (p: its row's distribution after temperature, min-p,
  top-k, top-p); on rejection the next token is drawn from p without d, renormalised, and
  verification ends; after k kept drafts one more token is drawn from the last row. Each
  emitted token is then distributed as p: p(d) for d, and (1 - p(d)) * p(x) / (1 - p(d))
  for x != d. The draws come from the request's generator (a seeded request's output is
  reproducible for a given speculative configuration, not the same as without it).

Logprobs are the target's raw ones (as without speculation) of the kept rows.
"""
from __future__ import annotations

import itertools

import torch

from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.logprobs import raw_logprobs, token_logprobs
from pdserve.common.engine.sampler import Sampled, Sampler, greedy
from pdserve.common.engine.sequence import Sequence


def verify(logits: torch.Tensor, seqs: list[Sequence], top: list[int] | None, sampler: Sampler, grammars: Grammars,
           generators: list[torch.Generator | None]) -> dict[int, Sampled]:
    """logits [R, V] float32: each of `seqs`' 1 + len(spec_token_ids) rows, in order
    (`top`: each row's argmax, where known) -> {seq_id: the tokens it keeps}. A sequence
    keeps its accepted drafts and one token of the target's (none after a draft that ends
    its grammar)."""
    counts = [1 + len(s.spec_token_ids) for s in seqs]
    params = [s.sampling_params for s, n in zip(seqs, counts) for _ in range(n)]
    raw = raw_logprobs(logits, params)  # taken before any processing, as without speculation
    bitmask, ends = grammars.draft_bitmask(seqs) if any(p.structured for p in params) else (None, {})
    history = num_prompt = None
    if any(p.logit_bias or p.min_tokens or p.uses_penalties for p in params):
        history = [s.token_ids + s.spec_token_ids[:i] for s, n in zip(seqs, counts) for i in range(n)]
        num_prompt = [s.num_prompt_tokens for s, n in zip(seqs, counts) for _ in range(n)]
    logits, top = sampler.process(logits, params, history, num_prompt, bitmask, top)
    argmax = top if top is not None else greedy(logits) if any(p.greedy for p in params) else None
    starts = list(itertools.accumulate(counts, initial=0))
    random = [i for i, p in enumerate(params) if not p.greedy]  # rows; all of a sequence's or none
    probs = sampler.probs(logits[random], [params[i] for i in random]) if random else None  # [len(random), V]
    kept: list[list[int]] = []
    j = 0  # the next random sequence's first row in `probs`
    for s, n, r, gen in zip(seqs, counts, starts, generators):
        drafts = s.spec_token_ids
        if s.sampling_params.greedy:
            a = 0
            while a < len(drafts) and argmax[r + a] == drafts[a]:
                a += 1
            tokens = [*drafts[:a], argmax[r + a]]
        else:
            tokens = _rejection_sample(probs[j:j + n], drafts, gen or sampler.generator)
            j += n
        end = ends.get(s.seq_id)
        if end is not None and len(tokens) > end:  # a kept draft ended the grammar: nothing follows it
            tokens = tokens[:end]
        kept.append(tokens)
    lps = {}
    if raw is not None:  # the kept tokens' logprobs from their rows (other rows: any token, unread)
        row_tokens = [t for tokens, n in zip(kept, counts) for t in (tokens + [0] * n)[:n]]
        lps = token_logprobs(raw, params, row_tokens)
    out = {}
    r = 0
    for s, n, tokens in zip(seqs, counts, kept):
        pairs = [(t, lps.get(r + i)) for i, t in enumerate(tokens)]
        out[s.seq_id] = Sampled(pairs[0][0], pairs[0][1], tuple(pairs[1:]), len(s.spec_token_ids))
        r += n
    return out


def _rejection_sample(probs: torch.Tensor, drafts: list[int], gen: torch.Generator) -> list[int]:
    """probs [k + 1, V]: each row's distribution; drafts [k], proposed deterministically ->
    the tokens emitted: the drafts kept (each with probability p(d), while kept), then one
    drawn from the first rejected draft's row without it, or from the last row."""
    k = len(drafts)
    u = torch.rand(k, generator=gen, device=probs.device)  # [k]
    p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(drafts, device=probs.device)]  # [k]
    kept = (u < p_draft).tolist()
    a = kept.index(False) if False in kept else k
    if a == k:
        return [*drafts, int(torch.multinomial(probs[k], 1, generator=gen)[0])]
    residual = probs[a].clone()  # [V]
    residual[drafts[a]] = 0.0
    if not residual.sum().item() > 0.0:  # rounding left p(d) just below 1 and nothing else: d it is
        return drafts[:a + 1]
    return [*drafts[:a], int(torch.multinomial(residual, 1, generator=gen)[0])]
