"""The share of an engine step spent outside the model forward, and where decode time
goes: pure-decode steps at a fixed batch are timed together with the time inside
`runner.model.forward` (wrapped on the instance, no library edit); overhead share =
1 - forward_time / step_time, also given with the lm_head (`compute_logits`) counted as
model time. A decode batch the native stack runs on to its logits (`decode_logits`: the
forward and the lm_head in one call) counts as forward time in both. `profile_decode` runs cProfile over further steps. Used by
offline_throughput.py.
"""
from __future__ import annotations

import cProfile
import io
import pstats
import time
from pathlib import Path
from typing import Any, Callable

from tqdm.auto import tqdm

from pdserve.common import SamplingParams
from benchmarks.harness.timing import Phase


class ForwardTimer:
    """Wraps a bound method on its instance and accumulates its wall time (seconds)."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner, self.name, self.seconds = owner, name, 0.0
        inner: Callable[..., Any] = getattr(owner, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        setattr(owner, name, timed)  # instance attribute shadows the class method

    def remove(self) -> None:
        delattr(self.owner, self.name)


def measure_overhead(llm: Any, prompts: list[list[int]], max_model_len: int, steps: int, profile_steps: int,
                     profile_out: Path | None) -> dict[str, Any]:
    """Time `steps` pure-decode steps with one running sequence per prompt (see the
    module docstring); then cProfile `profile_steps` more if asked."""
    engine = llm.engine
    batch = len(prompts)
    total = steps + profile_steps
    # max_model_len bounds prompt + outputs; every seq must outlive the measured steps
    if max(len(p) for p in prompts) + total + 2 > max_model_len:
        raise SystemExit("overhead phase: too many steps for max_model_len")
    params = SamplingParams(temperature=0, max_tokens=total + 2, ignore_eos=True)
    seqs = [engine.add_request(p, params) for p in prompts]
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in seqs):  # prefill all
        engine.step()
    fwd = ForwardTimer(engine.runner.model, "forward")
    logits = ForwardTimer(engine.runner.model, "compute_logits")
    fused = ForwardTimer(engine.runner.model, "decode_logits")
    step_s: list[float] = []
    try:
        with Phase() as phase:
            for _ in tqdm(range(steps), desc=f"decode steps @ batch {batch}", dynamic_ncols=True):
                t0 = time.perf_counter()
                out = engine.step()
                step_s.append(time.perf_counter() - t0)
                if len(out) != batch:
                    raise RuntimeError(f"expected {batch} decode outputs per step, got {len(out)}")
    finally:
        fwd.remove()
        logits.remove()
        fused.remove()
    step_total = sum(step_s)
    hotspots = profile_decode(engine, profile_steps, profile_out) if profile_steps else None
    for s in seqs:
        engine.abort(s)
    return {
        "batch": batch,
        "steps": steps,
        "step_ms_mean": 1e3 * step_total / steps,
        "forward_ms_mean": 1e3 * fwd.seconds / steps,
        "compute_logits_ms_mean": 1e3 * logits.seconds / steps,
        "decode_logits_ms_mean": 1e3 * fused.seconds / steps,
        "overhead_share": 1 - (fwd.seconds + fused.seconds) / step_total,
        "overhead_share_counting_lm_head_as_model": 1 - (fwd.seconds + logits.seconds + fused.seconds) / step_total,
        "other_cpu_share": phase.other_cpu_share,
        "profile_top": hotspots,
    }


def profile_decode(engine: Any, steps: int, out: Path | None, top: int = 25) -> list[dict[str, Any]]:
    """cProfile `steps` decode steps; returns the top functions by own (tottime) time."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        engine.step()
    prof.disable()
    if out is not None:
        prof.dump_stats(str(out))
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, fn), (_, ncalls, tottime, cumtime, _) in stats.stats.items():  # type: ignore[attr-defined]
        rows.append({"function": f"{Path(file).name}:{line}({fn})", "ncalls": ncalls,
                     "tottime_ms_per_step": 1e3 * tottime / steps, "cumtime_ms_per_step": 1e3 * cumtime / steps})
    rows.sort(key=lambda r: -r["tottime_ms_per_step"])
    return rows[:top]
