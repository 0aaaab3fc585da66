"""Routing choices as pure functions over plain data (no sockets, no clocks).

prefix_load (default): send the prompt where it waits behind and computes the fewest
blocks: the prompt blocks routed to the worker and not yet computed, less the prompt's
leading blocks already in its cache (the rest of the prompt costs every worker alike);
then the least loaded. A cached prefix thus draws a prompt for as many blocks as it
saves, not outright: a system prompt of one block shared by every conversation no longer
sends them all to one worker while another idles. Where load is badly imbalanced, the
least loaded worker wins.
round_robin and least_loaded exist for experiments. Ties are broken at random.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

POLICIES = ("prefix_load", "round_robin", "least_loaded")


@dataclass(frozen=True)
class WorkerView:
    """What a policy may know of one live worker."""

    worker_id: str
    load: int  # requests routed to it and not yet done with this phase
    free_blocks: int
    total_blocks: int
    prefix_blocks: int = 0  # leading prompt blocks found in its prefix cache
    queued_blocks: int = 0  # prompt blocks routed to it to compute and not yet computed

    @property
    def free_ratio(self) -> float:
        return self.free_blocks / self.total_blocks if self.total_blocks else 0.0


@dataclass(frozen=True)
class ImbalanceGuard:
    """Load counts as badly imbalanced when max > ratio * min + slack."""

    ratio: float = 2.0
    slack: int = 4

    def imbalanced(self, loads: list[int]) -> bool:
        return max(loads) > self.ratio * min(loads) + self.slack


def _check(policy: str, cands: list[WorkerView]) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown routing policy {policy!r} (choose from {', '.join(POLICIES)})")
    if not cands:
        raise ValueError("no live worker to choose from")


def _pick(cands: list[WorkerView], key, rng: random.Random) -> str:
    best = min(key(w) for w in cands)
    return rng.choice([w.worker_id for w in cands if key(w) == best])


def choose_prefill(cands: list[WorkerView], policy: str, rng: random.Random, rr_index: int = 0,
                   guard: ImbalanceGuard = ImbalanceGuard()) -> str:
    """The worker that computes a prompt (prefill or colocated role)."""
    _check(policy, cands)
    if policy == "round_robin":
        return sorted(w.worker_id for w in cands)[rr_index % len(cands)]
    if policy == "least_loaded" or guard.imbalanced([w.load for w in cands]):
        return _pick(cands, lambda w: w.load, rng)
    return _pick(cands, lambda w: (w.queued_blocks - w.prefix_blocks, w.load), rng)


def choose_decode(cands: list[WorkerView], policy: str, rng: random.Random, rr_index: int = 0) -> str:
    """The decode worker: most free KV blocks (as a share), then fewest running requests."""
    _check(policy, cands)
    if policy == "round_robin":
        return sorted(w.worker_id for w in cands)[rr_index % len(cands)]
    if policy == "least_loaded":
        return _pick(cands, lambda w: w.load, rng)
    return _pick(cands, lambda w: (-round(w.free_ratio, 2), w.load), rng)


def prefix_overlap(prompt_hashes: list[int], cached: set[int]) -> int:
    """Leading blocks of the prompt present in a worker's prefix index."""
    n = 0
    for h in prompt_hashes:
        if h not in cached:
            break
        n += 1
    return n
