"""What an engine's steps cost, measured in this process (`pdserve profile`, docs/slo.md):
  prefill   one fresh random prompt of each size (no prefix hit), first token sampled:
            seconds from queueing to its first token, all its chunks included;
  decode    `batch` sequences of `context` prompt tokens, prefilled first, then the
            median of `decode_steps` timed steps in which they all decode.
Each size is measured `reps` times after one warm-up. The KV transfer's cost is measured
beside it (kv_transfer/profile.py); the command that fits both into a latency model
(common/latency_model.py) is router/cli/profile.py."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from pdserve.common.config import ConfigError
from pdserve.common.sampling_params import SamplingParams

if TYPE_CHECKING:  # `pdserve profile`'s flags are read from ProfilePlan without importing torch
    from pdserve.common.engine.engine import LLMEngine

FIRST_ORDINARY_TOKEN = 3  # random prompts avoid the lowest ids, special tokens in made models


@dataclass(frozen=True)
class ProfilePlan:
    """What to measure: sizes per part, repetitions."""

    prefill_tokens: tuple[int, ...] = (16, 64, 256, 1024)
    batches: tuple[int, ...] = (1, 4, 16)
    contexts: tuple[int, ...] = (64, 512)
    blocks: tuple[int, ...] = (1, 8, 64)
    decode_steps: int = 8
    reps: int = 3

    def fitted_to(self, max_model_len: int, max_num_seqs: int) -> "ProfilePlan":
        """The plan without the sizes this engine cannot run; ConfigError if too little is left."""
        room = max_model_len - self.decode_steps - 2
        prefill = sorted({min(n, max_model_len - 1) for n in self.prefill_tokens})  # a prompt leaves room for a token
        plan = ProfilePlan(tuple(prefill),
                           tuple(b for b in self.batches if b <= max_num_seqs),
                           tuple(c for c in self.contexts if c <= room), self.blocks, self.decode_steps, self.reps)
        if len(plan.prefill_tokens) < 2 or len(set(plan.blocks)) < 2 or not plan.batches or not plan.contexts:
            raise ConfigError(f"profile: need >= 2 prefill sizes (below max_model_len {max_model_len}), >= 2 block "
                              f"counts, and a batch <= max_num_seqs {max_num_seqs} with a context that fits")
        if self.reps < 1 or self.decode_steps < 1 or min(self.blocks) < 1:
            raise ConfigError("profile: --reps, --decode-steps and every block count must be >= 1")
        return plan

    def kv_blocks(self, block_size: int, max_model_len: int) -> int:
        """Cache blocks the plan needs at once (its largest decode batch or transfer; an
        engine's cache holds at least one sequence of max_model_len)."""
        decode = max(self.batches) * -(-(max(self.contexts) + self.decode_steps + 2) // block_size)
        return max(decode, max(self.blocks), -(-max_model_len // block_size)) + 16


def _prompt(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=n).tolist()


def measure_prefill(engine: LLMEngine, plan: ProfilePlan, rng: np.random.Generator) -> list[tuple[int, float]]:
    vocab, out = engine.config.model.vocab_size, []
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for n in plan.prefill_tokens:
        for rep in range(plan.reps + 1):  # the first is a warm-up
            engine.add_request(_prompt(rng, n, vocab), params)
            t0 = time.perf_counter()
            while engine.has_work():
                engine.step()
            if rep:
                out.append((n, time.perf_counter() - t0))
    return out


def measure_decode(engine: LLMEngine, plan: ProfilePlan, rng: np.random.Generator) -> list[tuple[int, float, float]]:
    """(batch, mean context during the timed steps, median step seconds) per batch and context."""
    vocab, out = engine.config.model.vocab_size, []
    params = SamplingParams(temperature=0.0, max_tokens=plan.decode_steps + 2, ignore_eos=True)
    for batch in plan.batches:
        for context in plan.contexts:
            seqs = [engine.add_request(_prompt(rng, context, vocab), params) for _ in range(batch)]
            while any(s.num_output_tokens == 0 for s in seqs):  # their prefills, untimed
                engine.step()
            times = []
            for _ in range(plan.decode_steps):
                t0 = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t0)
            for s in seqs:
                engine.abort(s)
            out.append((batch, float(context + 1 + plan.decode_steps / 2), float(np.median(times))))
    return out
