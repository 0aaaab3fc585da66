"""The speculative decoding the engine drives: before each step it has draft tokens
proposed for the running sequences that decode (`propose`), the step verifies them
(model_runner, `verify`), and after it the engine reports what each kept (`record`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from collections.abc import Callable

import torch

from pdserve.common.config import EngineConfig, SpeculativeConfig
from pdserve.common.engine.sampler import Sampled
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.common.engine.sequence import Sequence
from pdserve.common.engine.spec.draft_model import DraftModelProposer
from pdserve.common.engine.spec.ngram import NgramProposer
from pdserve.common.engine.spec.policy import AdaptivePolicy
from pdserve.common.engine.spec.proposer import Proposer

DRAFT_MODEL_PRIOR = (3.0, 1.0)  # a draft model of the target's family agrees with it most of the time
NGRAM_PRIOR = (1.0, 1.0)


@dataclass
class SpecStats:
    """Counts since the engine started, as vLLM's spec_decode metrics: verifications
    (drafts), draft tokens verified, and of those accepted, in all and by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def add(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos += [0] * (num_accepted - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


class Speculator:
    """Owns the proposer, the policy and the counts of one engine's speculative decoding.
    Which sequences propose: running ones that decode (their prompt computed, one token
    uncomputed), not waiting for a grammar to start after their reasoning (whose mask
    would change within the drafts)."""

    def __init__(self, config: EngineConfig, spec: SpeculativeConfig, target: torch.nn.Module,
                 target_cache: torch.Tensor, eos_token_ids: frozenset[int]) -> None:
        self.config = config
        self.spec = spec
        self.eos_token_ids = eos_token_ids
        self.proposer: Proposer
        if spec.method == "ngram":
            self.proposer = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
            self.policy = AdaptivePolicy(draft_passes=False, prior=NGRAM_PRIOR, adaptive=spec.adaptive)
        else:
            proposer = DraftModelProposer(config, spec, target_cache, eos_token_ids)
            self.policy = AdaptivePolicy(draft_passes=True, prior=DRAFT_MODEL_PRIOR, adaptive=spec.adaptive,
                                         draft_ratio=weight_bytes(proposer.runner.model) / max(1, weight_bytes(target)))
            proposer.on_pass = self.policy.draft.observe  # type: ignore[union-attr]
            self.proposer = proposer
        self.stats = SpecStats()

    def propose(self, scheduler: Scheduler) -> None:
        """Give the running sequences that decode the draft tokens to verify in the next
        step (`Sequence.spec_token_ids`), with room for them in their blocks."""
        for s in scheduler.running:  # drafts of a step that left a sequence out are stale
            s.spec_token_ids = []
        seqs = [s for s in scheduler.running if self._decoding(s)]
        caps = [self._cap(s) for s in seqs]
        seqs, caps = [s for s, c in zip(seqs, caps) if c > 0], [c for c in caps if c > 0]
        if not seqs:
            return
        drafts: list[list[int]] | None = None
        if self.proposer.free:  # the drafts first: the policy then knows how many there are
            drafts = [self._until_stop(s, d) for s, d in zip(seqs, self.proposer.propose(seqs, caps))]
            caps = [len(d) for d in drafts]
        budget = scheduler.config.max_num_batched_tokens
        base_rows = min(budget, sum(min(s.num_uncomputed_tokens, budget) for s in scheduler.running))
        ks = self.policy.choose([s.seq_id for s in seqs], caps, base_rows, len(scheduler.running))
        chosen = [i for i, (s, k) in enumerate(zip(seqs, ks)) if k > 0 and scheduler.lookahead(s, 1 + k)]
        if drafts is None and chosen:
            proposed = self.proposer.propose([seqs[i] for i in chosen], [ks[i] for i in chosen])
            drafts = [[] for _ in seqs]
            for i, d in zip(chosen, proposed):
                drafts[i] = self._until_stop(seqs[i], d)
        for i in chosen:
            seqs[i].spec_token_ids = drafts[i][:ks[i]]  # type: ignore[index]

    def observe_step(self, batch: ScheduledBatch, seconds: float) -> None:
        """A step's forward and sampling took `seconds`: the cost model learns from a step
        of one-query rows alone (decodes and verifications; a prompt chunk costs otherwise)."""
        if all(n == 1 or s.spec_token_ids for s, n in zip(batch.seqs, batch.num_tokens)):
            self.policy.target.observe(batch.total_tokens, seconds)

    def settle(self, batch: ScheduledBatch, sampled: dict[int, Sampled], kept: Callable[[Sequence, list[int]], int]
               ) -> dict[int, list[tuple[int, TokenLogprobs | None]]]:
        """After a step: the tokens each verified sequence keeps (its accepted drafts, then
        the target's next token; `kept(seq, tokens)` says how many before it stops), by
        seq_id. Each gets the kept tokens but the last appended, and its count in `batch`
        set to its rows whose KV stands (its last token and those drafts), so
        `Scheduler.advance` counts and hashes accepted tokens only. Every sequence's drafts
        are consumed."""
        out = {}
        for i, seq in enumerate(batch.seqs):
            s = sampled.get(seq.seq_id)
            if seq.spec_token_ids and s is not None and s.num_draft:
                tokens = [(s.token, s.logprobs), *s.more]
                tokens = tokens[:kept(seq, [t for t, _ in tokens])]
                seq.token_ids += [t for t, _ in tokens[:-1]]
                batch.num_tokens[i] = len(tokens)
                out[seq.seq_id] = tokens
                self.record(seq, s.num_draft, len(s.more))
            seq.spec_token_ids = []
        return out

    def record(self, seq: Sequence, num_draft: int, num_accepted: int) -> None:
        """A verification of `seq` kept `num_accepted` of its `num_draft` drafts."""
        self.policy.record(seq.seq_id, num_draft, num_accepted)
        self.stats.add(num_draft, num_accepted)
        seq.num_draft_tokens += num_draft
        seq.num_accepted_tokens += num_accepted

    def release(self, seq_id: int) -> None:
        """`seq_id` ended, or lost its blocks (preempted; its draft KV with them)."""
        self.proposer.release(seq_id)
        self.policy.release(seq_id)

    @staticmethod
    def _decoding(seq: Sequence) -> bool:
        so = seq.sampling_params.structured
        return (seq.num_uncomputed_tokens == 1 and seq.num_output_tokens >= 1 and not seq.forks
                and (so is None or so.reasoning_end is None))

    def _cap(self, seq: Sequence) -> int:
        """The most drafts `seq` may verify: num_speculative_tokens, and no token past
        max_tokens or position past max_model_len (the token after the drafts included)."""
        p = seq.sampling_params
        return max(0, min(self.spec.num_speculative_tokens, p.max_tokens - seq.num_output_tokens - 1,
                          self.config.scheduler.max_model_len - len(seq) - 1))

    def _until_stop(self, seq: Sequence, drafts: list[int]) -> list[int]:
        """`drafts` up to and including the first that would end the sequence (an EOS or
        stop id): nothing after it can be kept."""
        stops = set(seq.sampling_params.stop_token_ids or ()) | self.eos_token_ids
        for i, t in enumerate(drafts):
            if t in stops:
                return drafts[:i + 1]
        return drafts


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of a model's weights (a quantized linear's: its blocks), each tensor once: the
    prior for how a draft pass costs against a target step, until both are measured."""
    seen: set[int] = set()
    total = 0
    for t in model.parameters():
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total + sum(m.quant.nbytes for m in model.modules() if getattr(m, "quant", None) is not None)
