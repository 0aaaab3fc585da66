"""Conditional disaggregation: per request, whether the chosen prefill worker computes
the prompt and hands its KV to the chosen decode worker, or the decode worker computes
it locally beside its running decodes. A pure function of plain data (`DisaggCase`);
the router fills the case from its routing state (router/core/disagg_state.py).

Modes (docs/slo.md):
  always     every prompt via the prefill worker (the default)
  never      every prompt on the decode worker
  threshold  via P when the part of the prompt D lacks has >= `threshold_tokens`
             tokens (llm-d's rule), unless P's queue holds more than
             `max_prefill_queue_tokens` prompt tokens (0: no such limit)
  cost       the smaller predicted TTFT, from a latency model (common/latency_model.py):
             via P = prefill(P's queue + its uncached part) + transfer(blocks D lacks);
             on D  = prefill(D's queued local prompts + the part D lacks) + one decode
             step of D's batch (the step it shares). Via P anyway when the step on D
             would exceed `tpot_guard_s` (the decodes' next token waits for it).
"""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.latency_model import LatencyModel

MODES = ("always", "never", "threshold", "cost")
DISAGG, LOCAL = "disagg", "local"  # the two decisions, as metrics label them


@dataclass(frozen=True)
class DisaggCase:
    """What the decider knows of one request and the pair chosen for it."""

    prompt_tokens: int
    uncached_on_decode: int    # prompt tokens D must compute if it prefills (>= 1)
    uncached_on_prefill: int   # prompt tokens P must compute (>= 1)
    transfer_blocks: int       # KV blocks that would move from P to D
    prefill_queue_tokens: int  # prompt tokens P has been given and not finished
    local_queue_tokens: int    # prompt tokens D computes locally and has not finished
    decode_batch: int          # sequences decoding on D
    decode_context: float      # their mean context, tokens


@dataclass(frozen=True)
class Decision:
    """The choice and why; `prefill_tokens` is what the chosen worker computes. The
    predictions (seconds) are set in cost mode."""

    disaggregate: bool
    reason: str
    prefill_tokens: int
    ttft_via_prefill_s: float | None = None
    ttft_on_decode_s: float | None = None

    @property
    def label(self) -> str:
        return DISAGG if self.disaggregate else LOCAL


@dataclass(frozen=True)
class DisaggPolicy:
    """The rule as data. `model` is required by cost mode."""

    mode: str = "always"
    threshold_tokens: int = 0
    max_prefill_queue_tokens: int = 0  # 0: no limit
    tpot_guard_s: float = 0.0          # 0: no guard
    model: LatencyModel | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"disaggregation mode {self.mode!r} is not one of {', '.join(MODES)}")
        if self.mode == "cost" and self.model is None:
            raise ValueError("disaggregation mode 'cost' needs a latency model (pdserve profile)")
        if self.threshold_tokens < 0 or self.max_prefill_queue_tokens < 0 or self.tpot_guard_s < 0:
            raise ValueError("disaggregation thresholds must be >= 0")

    def decide(self, case: DisaggCase) -> Decision:
        if self.mode == "always":
            return self._via_p(case, "always")
        if self.mode == "never":
            return self._local(case, "never")
        if self.mode == "threshold":
            if case.uncached_on_decode < self.threshold_tokens:
                return self._local(case, "short_prompt")
            if self.max_prefill_queue_tokens and case.prefill_queue_tokens > self.max_prefill_queue_tokens:
                return self._local(case, "prefill_queue")
            return self._via_p(case, "long_prompt")
        return self._by_cost(case)

    def _by_cost(self, case: DisaggCase) -> Decision:
        m = self.model
        assert m is not None  # __post_init__
        via_p = m.prefill_s(case.prefill_queue_tokens + case.uncached_on_prefill) + m.transfer_s(case.transfer_blocks)
        shared_step = m.decode_step_s(case.decode_batch, case.decode_context)
        on_d = m.prefill_s(case.local_queue_tokens + case.uncached_on_decode) + shared_step
        guarded = (self.tpot_guard_s > 0 and case.decode_batch > 0
                   and shared_step + m.prefill_s(case.uncached_on_decode) > self.tpot_guard_s)
        if guarded or via_p <= on_d:
            return Decision(True, "tpot_guard" if guarded and on_d < via_p else "cost", case.uncached_on_prefill,
                            via_p, on_d)
        return Decision(False, "cost", case.uncached_on_decode, via_p, on_d)

    @staticmethod
    def _via_p(case: DisaggCase, reason: str) -> Decision:
        return Decision(True, reason, case.uncached_on_prefill)

    @staticmethod
    def _local(case: DisaggCase, reason: str) -> Decision:
        return Decision(False, reason, case.uncached_on_decode)
