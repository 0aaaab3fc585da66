"""Teacher-forced logits of a token sequence, and the checks below float32 built on them:
vLLM's greedy top-k rule and perplexity (docs/kernels.md, "Precision on the CPU").

`sequence_logits` runs a whole sequence as one prefill on an idle engine and reads the
logits of every position (vLLM's prompt_logprobs); the rest are pure functions over those.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pdserve.common.engine.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams


def sequence_logits(engine: LLMEngine, token_ids: list[int]) -> torch.Tensor:
    """[len, V] float32: row i holds the logits of the token after token_ids[:i + 1]. The
    engine must be idle and take the sequence in one step (max_num_batched_tokens >= its
    length, no prefix-cache hit: build it with enable_prefix_caching=False)."""
    seq = engine.new_sequence(token_ids, SamplingParams(temperature=0, max_tokens=1))
    engine.add(seq)
    try:
        batch = engine.scheduler.schedule()
        if batch.seqs != [seq] or batch.num_tokens != [len(token_ids)]:
            raise ValueError(f"sequence_logits: the engine scheduled {batch.num_tokens} tokens of {len(token_ids)} "
                             "(it must be idle, take the whole sequence in one step, without a prefix-cache hit)")
        runner = engine.runner
        ids, positions, meta, _, _ = runner.prepare(batch.seqs, batch.num_tokens)
        with torch.inference_mode():
            return runner.model.compute_logits(runner.model(ids, positions, meta))
    finally:
        engine.abort(seq)


@dataclass(frozen=True)
class Divergence:
    """Where two greedy streams first differ, and each side's token's rank in the other's
    logits there (0 = the top); None fields when they never differ."""

    position: int | None
    a_token: int | None = None
    b_token: int | None = None
    a_rank_in_b: int | None = None
    b_rank_in_a: int | None = None

    def within_top(self, k: int) -> bool:
        """vLLM's rule below float32: identical, or each token in the other's top-k."""
        return self.position is None or (self.a_rank_in_b < k and self.b_rank_in_a < k)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where the streams differ (the shorter's length if one is a prefix
    of the other and they differ in length), else None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def rank(logits: torch.Tensor, token: int) -> int:
    """token's rank in logits [V] (0: the largest; ties counted in its favour)."""
    return int((logits > logits[token]).sum())


def divergence(prompt: list[int], a: list[int], b: list[int], a_engine: LLMEngine, b_engine: LLMEngine
               ) -> Divergence:
    """Compare greedy continuations a (from a_engine) and b (from b_engine) of `prompt`:
    at their first difference, each engine's teacher-forced logits on the common prefix."""
    i = first_divergence(a, b)
    if i is None or i >= min(len(a), len(b)):
        return Divergence(None)
    common = prompt + a[:i]
    la, lb = sequence_logits(a_engine, common)[-1], sequence_logits(b_engine, common)[-1]
    return Divergence(i, a[i], b[i], rank(lb, a[i]), rank(la, b[i]))


def perplexity(logits: torch.Tensor, token_ids: list[int]) -> float:
    """exp(mean negative log-likelihood) of token_ids[1:] under logits [len, V] of
    `sequence_logits(engine, token_ids)`."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)
    nll = -logp.gather(1, torch.tensor(token_ids[1:])[:, None]).mean()
    return math.exp(float(nll))
