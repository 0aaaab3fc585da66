"""Shared test helpers: the transformers oracle and prompt builders."""
from __future__ import annotations

import contextlib
import random


def hf_reference_cache():
    """A memoized transformers greedy `generate`, one model load per directory."""
    import torch
    from transformers import AutoModelForCausalLM

    models: dict[str, object] = {}
    results: dict[tuple, list[int]] = {}

    def generate(model_dir: str, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        key = (model_dir, tuple(prompt_ids), max_new_tokens)
        if key not in results:
            if model_dir not in models:
                models[model_dir] = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
            model = models[model_dir]
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                                     max_new_tokens=max_new_tokens, do_sample=False)
            results[key] = out[0, len(prompt_ids):].tolist()
        return results[key]

    return generate


def mixed_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """16+ prompts of mixed lengths: some cross block boundaries (block 16), some are long
    enough to be chunked by a small token budget, and some share long prefixes."""
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731  (0-2 are special)
    lengths = [1, 5, 15, 16, 17, 31, 33, 47, 64, 65, 100, 129, 150, 200]
    prompts = [ids(n) for n in lengths]
    base = ids(70)
    prompts += [base + ids(9), base + ids(30), base[:48] + ids(5), base[:32]]
    return prompts


@contextlib.contextmanager
def one_torch_thread():
    """Run torch on one intra-op thread, then restore the old count. On 2 shared cores,
    a second thread next to worker processes (or other jobs) makes steps >10x slower."""
    import torch
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(old)
