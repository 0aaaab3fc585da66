"""Turning last-position logits into next tokens: greedy, temperature, top-k, top-p,
with a per-request generator when the request carries a seed."""
from __future__ import annotations

import torch

from common.sampling_params import SamplingParams


class Sampler:
    """Owns the engine-wide generator used by unseeded random requests.

    Seeded requests get their own generator (created on first use, kept by the caller
    in `generators`), so their output does not depend on what they are batched with.
    """

    def __init__(self, seed: int = 0, device: str = "cpu") -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.device = device

    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None]) -> list[int]:
        """logits [B, V] float32 -> one token id per row."""
        greedy_ids = logits.argmax(dim=-1)  # [B]
        if all(p.greedy for p in params):
            return greedy_ids.tolist()
        out = greedy_ids.clone()
        rows = [i for i, p in enumerate(params) if not p.greedy]
        temps = torch.tensor([params[i].temperature for i in rows], device=logits.device)
        probs = torch.softmax(logits[rows] / temps[:, None], dim=-1)  # [R, V]
        probs = _filter_top_k_top_p(probs, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
        for j, i in enumerate(rows):
            gen = generators[i] or self.generator
            out[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        return out.tolist()


def _filter_top_k_top_p(probs: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Zero out tokens outside each row's top-k and top-p nucleus; renormalize. probs [R, V]."""
    if all(k == -1 for k in top_k) and all(p >= 1.0 for p in top_p):
        return probs
    sorted_p, idx = probs.sort(dim=-1, descending=True)  # [R, V]
    vocab = probs.shape[-1]
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=probs.device)  # int64-safe
    ranks = torch.arange(vocab, device=probs.device)[None, :]
    keep = ranks < ks[:, None]
    ps = torch.tensor(top_p, device=probs.device, dtype=probs.dtype)
    # keep a token if the mass strictly before it is < top_p; the top token always stays,
    # also when top_p underflows to 0 in float32 (1e-300), or no token would be left
    keep &= ((sorted_p.cumsum(-1) - sorted_p) < ps[:, None]) | (ranks == 0)
    sorted_p = sorted_p * keep
    filtered = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return filtered / filtered.sum(-1, keepdim=True)


def make_generator(seed: int, device: str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)
