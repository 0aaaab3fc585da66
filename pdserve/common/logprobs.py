"""Log-probabilities of sampled and prompt tokens: the one form they take from the sampler to the
client, the wire form too (common/wire/messages.py). Torch-free: the router imports it."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TokenLogprobs:
    """One sampled token's log-probability and the step's `n` most likely tokens (n =
    the request's `SamplingParams.logprobs`), most likely first. As vLLM's default
    `logprobs_mode` (raw_logprobs): log_softmax in float32 of the model's raw logits,
    before logit bias, penalties, temperature and the top-k/top-p/min-p filters. Ids and
    values as two parallel lists: msgpack map keys must be strings. `rank` (1 = most
    likely) is the token's rank in the whole vocabulary, given for prompt tokens only
    (vLLM's prompt_logprobs report it)."""

    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)
    rank: int | None = None
