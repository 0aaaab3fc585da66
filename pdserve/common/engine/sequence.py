"""One request's tokens, KV blocks and progress, as the scheduler and runner see it."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"      # queued for (re)computation by this engine
    RESERVED = "reserved"    # holds blocks for its whole prompt; the KV comes from elsewhere
    RUNNING = "running"      # in the continuous batch
    PREFILLED = "prefilled"  # prefill-only engine: first token sampled, blocks held until released
    FINISHED = "finished"    # holds nothing


@dataclass
class Sequence:
    """Owns a request's token ids (prompt + output) and its block table.

    Invariant: tokens [0, num_computed_tokens) have their KV in the blocks of
    `block_table`; the sequence samples a new token after a step that brings
    num_computed_tokens up to len(token_ids).
    """

    seq_id: int
    token_ids: list[int]
    sampling_params: SamplingParams
    num_prompt_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_hashed_blocks: int = 0  # leading blocks already registered in the prefix cache
    block_hashes: list[int] = field(default_factory=list)  # hashes of the hashed blocks
    # chained hashes of the prompt's full blocks, when known up front (computed once, by
    # the router or `LLMEngine.new_sequence`); others are computed as blocks fill
    prompt_hashes: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_preemptions: int = 0
    # structured output: the grammar matcher (common/engine/grammar.py), made on first use and
    # advanced only through appended tokens, so it survives preemption; dropped on release
    grammar: Any = None
    # SamplingParams.prompt_logprobs: one entry per prompt token (the first stays None), written
    # by position as the prompt's chunks are computed (a recomputed chunk overwrites its own);
    # None once they are sent (with the first output) or when not asked: a plain attribute, so
    # the per-step checks of every sequence cost one read
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    # n > 1: which choice this is (0: the sequence that computes the prompt), and, until the
    # prompt is computed, the other choices: they sample their first tokens from the same
    # logits, then take the prompt's KV blocks (LLMEngine.fork) and go on on their own
    index: int = 0
    forks: list["Sequence"] = field(default_factory=list)
    # speculative decoding (common/engine/spec/): the draft tokens proposed for the next step, after the
    # last token (the step computes 1 + len of them; the runner verifies them; consumed by that step), and
    # the request's totals of draft tokens verified and accepted (they survive preemption)
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.num_prompt_tokens:
            self.num_prompt_tokens = len(self.token_ids)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None and self.index == 0:
            # the request's prompt logprobs: computed and sent once, by the choice that computes the prompt
            self.prompt_logprobs = [None] * self.num_prompt_tokens

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED


class SeqIdCounter:
    """Hands out sequence ids; one per engine, not a class-level global."""

    def __init__(self, start: int = 0) -> None:
        self._it = itertools.count(start)

    def next(self) -> int:
        return next(self._it)
