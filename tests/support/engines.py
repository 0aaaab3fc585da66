"""Engines of every role over one tiny model, their prompts, and the checks that they
returned every block; quantized engines and vLLM's top-5 rule against float32."""
from __future__ import annotations

import random

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import LLMEngine
from pdserve.common.engine.scoring import divergence
from benchmarks.decode.gguf_kquant import TEXT as TEXT  # the one text perplexity is scored on (the benchmark's too)

PROMPTS = ([5, 6, 7, 8, 9, 10], list(range(100, 140)))
BLOCK = 16
MAX_LEN = 128


def config(model_dir: str, **kw) -> EngineConfig:
    opts = dict(block_size=BLOCK, num_kv_blocks=32, max_model_len=MAX_LEN, max_num_batched_tokens=64, num_threads=1)
    opts.update(kw)
    return EngineConfig.build(model_dir, **opts)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def check_baseline(*engines: LLMEngine) -> None:
    for e in engines:
        bm = e.block_manager
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
        s = e.scheduler
        assert not s.waiting and not s.running and not s.reserved
        assert not e.runner._generators


def make(model_dir: str, quantization: str) -> LLM:
    return LLM(str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256, quantization=quantization,
               enable_prefix_caching=False)


def assert_within_top5(ours: LLM, ref: LLM) -> None:
    """vLLM's rule: where the greedy streams first differ, each token in the other's top 5."""
    for prompt in PROMPTS:
        d = divergence(prompt, greedy(ours, prompt), greedy(ref, prompt), ours.engine, ref.engine)
        assert d.within_top(5), (prompt, d)


def greedy(llm: LLM, prompt: list[int], n: int = 16) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]


