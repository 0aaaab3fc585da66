"""The router's side of conditional disaggregation (router/core/disagg_policy.py): the policy
its config names, each request's `DisaggCase` read from the routing state -- the
workers' prefix indexes and the requests in flight -- and where a decision shows: the
request's timeline and the `pdserve_disagg_decisions_total` counter."""
from __future__ import annotations

from collections.abc import Iterable

from pdserve.common.config import ConfigError
from pdserve.common.timeline import Stamp, Timeline, mark
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_policy import Decision, DisaggCase, DisaggPolicy
from pdserve.common.latency_model import LatencyModel
from pdserve.router.core.metrics import RouterMetrics
from pdserve.router.core.policy import prefix_overlap
from pdserve.router.core.registry import WorkerEntry
from pdserve.router.core.requests import InFlight

__all__ = ["Decision", "Disaggregation", "disagg_case", "policy_from_config"]


class Disaggregation:
    """Owns the deployment's disaggregation policy and counts its decisions."""

    def __init__(self, config: RouterConfig, metrics: RouterMetrics) -> None:
        self.policy = policy_from_config(config)
        self.block_size = config.block_size
        self.metrics = metrics

    def decide(self, prompt_len: int, hashes: list[int], decode: WorkerEntry, prefill: WorkerEntry,
               inflight: Iterable[InFlight]) -> Decision:
        """The decision for a prompt routed to `decode` and `prefill`, counted; D's prefix
        index takes the prompt's blocks (its KV ends there either way)."""
        choice = self.policy.decide(disagg_case(prompt_len, hashes, decode, prefill, inflight, self.block_size))
        self.metrics.disagg_decisions.labels(choice.label, choice.reason).inc()
        decode.cached.update(hashes)
        return choice

    def mark(self, timeline: Timeline, choice: Decision | None, at: float) -> None:
        """Stamp the decision (`route_disagg` / `route_local`) where the mode can vary it."""
        if choice is not None and self.policy.mode != "always":
            mark(timeline, Stamp.ROUTE_DISAGG if choice.disaggregate else Stamp.ROUTE_LOCAL, at)


def policy_from_config(config: RouterConfig) -> DisaggPolicy:
    """ConfigError if the latency model file cannot be read or the rule is incomplete."""
    model = LatencyModel.load(config.disagg_latency_model) if config.disagg_latency_model else None
    try:
        return DisaggPolicy(config.disagg, config.disagg_threshold_tokens, config.disagg_max_prefill_queue,
                            config.disagg_tpot_guard_ms / 1000, model)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def disagg_case(prompt_len: int, hashes: list[int], decode: WorkerEntry, prefill: WorkerEntry,
                inflight: Iterable[InFlight], block_size: int) -> DisaggCase:
    """`hashes`: the prompt's blocks a prefix cache can match (all but the one holding its
    last token). A worker's cached part is the prompt's leading blocks in its prefix index
    (heartbeat events, plus what the router sent it since). Queues are the router's own
    count: prompt tokens of requests sent to a worker that have not had their first token."""
    on_d, on_p = prefix_overlap(hashes, decode.cached), prefix_overlap(hashes, prefill.cached)
    p_queue = d_queue = batch = context = 0
    for r in inflight:
        if r.first_token_at is None:
            tokens = r.route.prefill_tokens if r.route is not None else r.num_prompt_tokens
            if r.prefill is prefill:
                p_queue += tokens
            elif r.prefill is None and r.decode is decode:
                d_queue += tokens
        elif r.decode is decode:
            batch += 1
            context += r.num_prompt_tokens + r.num_output_tokens
    return DisaggCase(prompt_len, prompt_len - on_d * block_size, prompt_len - on_p * block_size,
                      -(-prompt_len // block_size) - on_d, p_queue, d_queue, batch, context / batch if batch else 0.0)
