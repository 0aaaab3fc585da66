"""The interface every proposer of draft tokens implements."""
from __future__ import annotations

from typing import Protocol

from pdserve.common.engine.sequence import Sequence


class Proposer(Protocol):
    """Proposes draft tokens to follow running sequences' tokens. `free`: proposing costs
    no model pass (the speculator then proposes first and lets the policy decide how many
    of the drafts to verify); else the policy decides first and only those are drafted."""

    free: bool

    def propose(self, seqs: list[Sequence], num_tokens: list[int]) -> list[list[int]]:
        """At most num_tokens[i] (>= 1) draft tokens to follow seqs[i]'s tokens, each
        sequence's last token not yet computed by the target (its KV slot and those of its
        drafts are allocated); [] where it has none to propose."""

    def release(self, seq_id: int) -> None:
        """Forget what is kept for a sequence: it ended, or lost its KV blocks (preempted)."""
