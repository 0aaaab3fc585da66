"""The in-the-box anchor: transformers' own `generate` on the same model folder, greedy,
with its static KV cache (`cache_implementation="static"`), eager and compiled (on a GPU,
transformers compiles the forward of a static-cache generate itself; eager is
`disable_compile=True`). Decode step times come from a stopping criterion that stamps the
time after each generated token (after synchronising), the same way the engine's are
taken: the median interval once every row is decoding."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, StoppingCriteria, StoppingCriteriaList

from benchmarks.gpu.engine_runs import random_ids
from benchmarks.gpu.limits import sync


class _Stamps(StoppingCriteria):
    """Never stops; records when each token was there (transformers calls it after each)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        sync(self.device)
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def load(model_dir: str, device: torch.device, dtype: torch.dtype) -> tuple[AutoModelForCausalLM, float]:
    """The model on `device` in `dtype`, and the seconds it took."""
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map=str(device)).eval()
    return model, time.perf_counter() - t0


def generate_steps(model, batch: int, prompt_len: int, new_tokens: int, compiled: bool, seed: int) -> dict:
    """Median ms per decode step of a greedy static-cache generate of `batch` prompts of
    `prompt_len` random ids, `new_tokens` each; one untimed generate of the same shapes first
    (where compiled, the compilation happens in it and is reported)."""
    device = model.device
    vocab = model.config.vocab_size
    rng = np.random.default_rng(seed)

    def run() -> list[float]:
        ids = torch.tensor([random_ids(rng, vocab, prompt_len) for _ in range(batch)], device=device)
        stamps = _Stamps(device)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                           disable_compile=not compiled, stopping_criteria=StoppingCriteriaList([stamps]),
                           pad_token_id=0)
        return stamps.times

    t0 = time.perf_counter()
    run()
    first_s = time.perf_counter() - t0
    times = run()
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "compiled": compiled,
            "first_call_s": first_s, "decode_steps": len(gaps), "ms_per_step_median": statistics.median(gaps) * 1e3,
            "ms_per_step_mean": statistics.fmean(gaps) * 1e3}
