"""Turning last-position logits into next tokens. Every logits feature lives here once,
and the prefill worker (first token) and the decode worker (the rest) run this same code
on the same SamplingParams and token history: logit bias, the min_tokens mask, the
repetition / presence / frequency penalties, then greedy or temperature, min-p, top-k,
top-p with a per-request generator when the request carries a seed."""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from pdserve.common.engine.grammar import apply_bitmask
from pdserve.common.engine.host_copy import device_tensor, to_device
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams


class Sampled(NamedTuple):
    """One sequence's sampled token and, when its request asks, its log-probabilities. A
    verified sequence (speculative decoding) also has `more`: the tokens after `token` it
    keeps from the same step, each with its logprobs (the drafts the target accepted, then
    the target's own token), and `num_draft`, how many draft tokens were verified; of
    those, the first len(more) were accepted."""
    token: int
    logprobs: TokenLogprobs | None = None
    more: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    num_draft: int = 0


class Sampler:
    """Owns the engine-wide generator used by unseeded random requests, and the EOS ids
    the min_tokens mask hides (the engine sets `eos_token_ids` once it knows them).

    Seeded requests get their own generator (created on first use, kept by the caller
    in `generators`), so their output does not depend on what they are batched with.
    """

    def __init__(self, seed: int = 0, device: str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device
        self.eos_token_ids: frozenset[int] = frozenset()

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None],
                 token_ids: list[list[int]] | None = None, num_prompt_tokens: list[int] | None = None,
                 bitmask: tuple[torch.Tensor, list[int]] | None = None, top: list[int] | None = None) -> list[int]:
        """logits [B, V] float32 -> one token id per row. `token_ids[i]` is row i's whole
        sequence so far (prompt then output; `num_prompt_tokens[i]` of it prompt): needed
        only when some row uses min_tokens or a penalty. `bitmask` (mask [B, V/32], rows):
        the structured-output rows' allowed tokens, applied first. `top`: each row's
        argmax of `logits` as given, where known (the native decode stack's): greedy rows
        take it when neither the mask nor a logits feature changes the logits."""
        logits, top = self.process(logits, params, token_ids, num_prompt_tokens, bitmask, top)
        if all(p.greedy for p in params):
            return greedy(logits) if top is None else top
        out = logits.argmax(dim=-1)  # [B]
        rows = [i for i, p in enumerate(params) if not p.greedy]
        picked = logits if len(rows) == len(params) else logits.index_select(0, device_tensor(rows, torch.int64, logits.device))
        probs = self.probs(picked, [params[i] for i in rows])
        for j, i in enumerate(rows):
            gen = generators[i] or self.generator
            out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out.tolist()

    def process(self, logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]] | None,
                num_prompt_tokens: list[int] | None, bitmask: tuple[torch.Tensor, list[int]] | None = None,
                top: list[int] | None = None) -> tuple[torch.Tensor, list[int] | None]:
        """The logits [B, V] every row samples from (a copy where the grammar's mask or a
        logits feature changes them; `__call__` says which) and `top` where it still holds."""
        if bitmask is not None:
            logits = logits.clone()
            apply_bitmask(logits, *bitmask)
            top = None
        if any(_touches_logits(p) for p in params):  # one check: a plain step costs nothing more
            assert token_ids is not None and num_prompt_tokens is not None, "penalties need the token history"
            logits = process_logits(logits.clone(), params, token_ids, num_prompt_tokens, self.eos_token_ids)
            top = None
        return logits, top

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Processed logits [R, V] of random (not greedy) rows -> the distribution [R, V]
        each samples from: temperature, then min-p, top-k and top-p."""
        temps = device_tensor([p.temperature for p in params], torch.float32, logits.device)
        probs = torch.softmax(logits / temps[:, None], dim=-1)  # [R, V]
        probs = _filter_min_p(probs, [p.min_p for p in params])
        return _filter_top_k_top_p(probs, [p.top_k for p in params], [p.top_p for p in params])


def greedy(logits: torch.Tensor) -> list[int]:
    """logits [B, V] -> each row's first index of its largest value, as torch.argmax; on
    CPU float32 by numpy's vectorized argmax (~10x torch's at a 49k vocabulary)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(dim=-1).tolist()


def _touches_logits(p: SamplingParams) -> bool:
    return bool(p.logit_bias) or p.min_tokens > 0 or p.uses_penalties


def process_logits(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                   num_prompt_tokens: list[int], eos_token_ids: frozenset[int]) -> torch.Tensor:
    """Apply, in place and in vLLM's order, each row's logit bias, min_tokens mask and
    penalties to logits [B, V]; batched per feature over the rows that use it."""
    vocab = logits.shape[-1]
    dev = logits.device
    bias = [(i, t, b) for i, p in enumerate(params) for t, b in (p.logit_bias or ())]
    if bias:
        rows, cols, vals = zip(*bias)
        # ids past the vocabulary are refused at the edge and by the engine; the assert is the invariant
        assert max(cols) < vocab, "logit_bias id outside the vocabulary"
        logits.index_put_((device_tensor(rows, torch.int64, dev), device_tensor(cols, torch.int64, dev)),
                          device_tensor(vals, logits.dtype, dev), accumulate=True)
    banned = [(i, t) for i, p in enumerate(params)
              if p.min_tokens and len(token_ids[i]) - num_prompt_tokens[i] < p.min_tokens
              for t in _stop_ids(p, eos_token_ids) if t < vocab]
    if banned:
        _ban(logits, banned, [p.structured is not None for p in params])
    pen = [i for i, p in enumerate(params) if p.uses_penalties]
    if len(pen) == len(params):  # every row: in place, no [R, V] copy out and back
        _apply_penalties(logits, params, token_ids, num_prompt_tokens)
    elif pen:
        logits[pen] = _apply_penalties(logits[pen], [params[i] for i in pen], [token_ids[i] for i in pen],
                                       [num_prompt_tokens[i] for i in pen])
    return logits


def _ban(logits: torch.Tensor, banned: list[tuple[int, int]], constrained: list[bool]) -> None:
    """min_tokens: the (row, id) ends to -inf, except in a constrained row whose grammar
    allows nothing else (its mask left only ends): there the grammar's end wins, and the
    request stops before min_tokens rather than sample from no token at all."""
    dev = logits.device
    rows, cols = (device_tensor(x, torch.int64, dev) for x in zip(*banned))
    guarded = sorted({i for i, _ in banned if constrained[i]})
    if not guarded:
        logits[rows, cols] = float("-inf")
        return
    kept = logits[rows, cols]  # [N]: the ends' logits before the ban
    logits[rows, cols] = float("-inf")
    alive = torch.ones(logits.shape[0], dtype=torch.bool, device=dev)  # [B]: a row has a token left
    alive[guarded] = torch.isfinite(logits[guarded]).any(dim=-1)
    logits[rows, cols] = torch.where(alive[rows], logits[rows, cols], kept)


def _stop_ids(p: SamplingParams, eos_token_ids: frozenset[int]) -> set[int]:
    """The ids that would end `p`'s request: what min_tokens hides (vLLM: EOS unless ignore_eos)."""
    ids = set(p.stop_token_ids or ())
    return ids if p.ignore_eos else ids | eos_token_ids


def _apply_penalties(logits: torch.Tensor, params: list[SamplingParams], token_ids: list[list[int]],
                     num_prompt: list[int]) -> torch.Tensor:
    """logits [R, V] of the rows with a penalty -> the same tensor, penalised in place.

    The rows' token ids are laid out anew each step in a padded [R, L] tensor, not kept as
    per-sequence counts: nothing to hand from P to D, to release, or to put back when a
    failed step is re-run. Work is O(R * L) gathers and scatters on those ids plus one
    [R, V] count (only with presence/frequency), not passes over [R, V]: a step's cost
    grows with the penalised rows' lengths, not with the vocabulary."""
    rows, vocab = logits.shape
    dev = logits.device
    longest = max(len(t) for t in token_ids)
    ids = np.empty((rows, longest), dtype=np.int64)
    is_out = np.zeros((rows, longest), dtype=np.float32)
    for r, (toks, n_prompt) in enumerate(zip(token_ids, num_prompt)):
        ids[r, :len(toks)] = toks
        ids[r, len(toks):] = toks[0]  # padding: a token the row has; a repeat changes nothing below
        is_out[r, n_prompt:len(toks)] = 1.0
    ids_t = to_device(ids, dev)  # [R, L]
    out_w = to_device(is_out, dev)  # [R, L]: 1 at output positions
    if any(p.repetition_penalty != 1.0 for p in params):
        rep = device_tensor([p.repetition_penalty for p in params], logits.dtype, dev)[:, None]
        # transformers' RepetitionPenaltyLogitsProcessor (gather, where, scatter): every token of
        # the prompt and output moves toward -inf; a repeated id writes the same value again
        seen = logits.gather(1, ids_t)  # [R, L]
        logits.scatter_(1, ids_t, torch.where(seen < 0, seen * rep, seen / rep))
    if any(p.presence_penalty or p.frequency_penalty for p in params):
        freq = device_tensor([p.frequency_penalty for p in params], logits.dtype, dev)[:, None]
        pres = device_tensor([p.presence_penalty for p in params], logits.dtype, dev)[:, None]
        counts = torch.zeros(rows, vocab, device=dev, dtype=logits.dtype).scatter_add_(1, ids_t, out_w)  # [R, V]
        per = counts.gather(1, ids_t).clamp_min(1.0)  # [R, L]: the output count of each position's token
        # OpenAI: logit -= count * frequency + (count > 0) * presence, over output tokens; each of
        # a token's `count` output positions subtracts frequency and 1/count of presence
        logits.scatter_add_(1, ids_t, -out_w * (freq + pres / per))
    return logits


def _filter_min_p(probs: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Zero out tokens whose probability is below min_p times the row's top probability;
    renormalize. probs [R, V]. The top token always stays (min_p <= 1)."""
    if all(m <= 0.0 for m in min_p):
        return probs
    ms = device_tensor(min_p, probs.dtype, probs.device)[:, None]
    probs = probs * (probs >= ms * probs.max(dim=-1, keepdim=True).values)
    return probs / probs.sum(-1, keepdim=True)


def _filter_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus; renormalize. probs [R, V]."""
    if all(k <= 0 for k in top_k) and all(p >= 1.0 for p in top_p):  # -1 and 0 both mean off
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)  # [R, V]
    vocab = probs.shape[-1]
    ks = device_tensor([min(k, vocab) if k > 0 else vocab for k in top_k], torch.int64, probs.device)
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    keep = ranks < ks[:, None]
    ps = device_tensor(top_p, probs.dtype, probs.device)
    # keep a token if the mass strictly before it is < top_p; the top token always stays,
    # also when top_p underflows to 0 in float32 (1e-300), or no token would be left
    keep &= ((sorted_p.cumsum(-1) - sorted_p) < ps[:, None]) | (ranks == 0)
    sorted_p = sorted_p * keep
    filtered = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return filtered / filtered.sum(-1, keepdim=True)


def make_generator(seed: int, device: str = "cpu") -> torch.Generator:
    """A generator for a request's seed: any int64, negative too, taken mod 2**64 (torch
    seeds are unsigned 64-bit; seeds in [0, 2**63) keep the stream they always had)."""
    return torch.Generator(device=device).manual_seed(seed % 2**64)
