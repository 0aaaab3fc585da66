"""What at_size.py times on pdserve's engine: decode steps of a batch at a given context,
prefill of one long prompt and of a mixed batch (with and without cached prefixes), and
the engine's own decode steps for the comparison with transformers.

Decode steps are timed on the engine's runner (the decode role's `GraphRunner`: CUDA
graphs per batch bucket, the same `execute` a decode worker calls) with sequences made
here whose context is already "in" the cache: each holds its own blocks (no two share
one), the cache filled with random values once. A batch of 64 at 4k context is then one
cache fill instead of 256k tokens of prefill, and what is timed is the step: the inputs'
copy, the graph, the logits and the greedy pick, as a decode worker runs it (its scheduler
apart, which `engine_decode` includes)."""
from __future__ import annotations

import statistics
import time

import numpy as np
import torch

from benchmarks.gpu.limits import sync
from pdserve.common.engine.llm import LLM
from pdserve.common.engine.scheduler import ScheduledBatch
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.sampling_params import SamplingParams

FIRST_ID = 3  # ids 0-2 are special tokens in models made by `pdserve make-model`


def random_ids(rng: np.random.Generator, vocab: int, n: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, size=n).tolist()


def weight_bytes_per_step(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter, less the embedding table
    unless it is also the lm_head (a step reads one row of it per sequence)."""
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    if not model.config.tie_word_embeddings:
        embed = model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(llm: LLM) -> int:
    """K and V of one token over every layer, in the cache's dtype."""
    cache = llm.engine.runner.kv_cache  # [2, layers, blocks, block_size, heads, dim]
    return 2 * cache.shape[1] * cache.shape[4] * cache.shape[5] * cache.element_size()


def prefill_flops(model: torch.nn.Module, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` tokens: 2 x the decoder linears' weights x tokens,
    the lm_head on the one sampled row, attention's QK^T and PV over the causal pairs
    (4 x layers x heads x head_dim x T(T+1)/2). Norms, RoPE, softmax and the activation
    left out, as usual (benchmarks/prefill_flops.py counts the same)."""
    from pdserve.common.models.layers import Linear
    cfg = model.config
    linears = sum(m.in_features * m.out_features for name, m in model.named_modules()
                  if isinstance(m, Linear) and name != "lm_head")
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * linears * tokens + 2 * cfg.hidden_size * cfg.vocab_size + attention


def blocks_for(batch: int, context: int, steps: int, block_size: int) -> int:
    """Cache blocks a decode timing of `steps` steps at `context` holds, every sequence its own."""
    return batch * -(-(context + steps + 2) // block_size)


def decode_step(llm: LLM, batch: int, context: int, steps: int, warmup: int = 3, seed: int = 0) -> dict:
    """Seconds per decode step of `batch` sequences at `context` tokens of context, on the
    runner; the context's K/V is whatever the cache holds (random, `fill_cache`)."""
    runner = llm.engine.runner
    bs = runner.block_size
    per_seq = -(-(context + warmup + steps + 2) // bs)
    rng = np.random.default_rng(seed)
    vocab = llm.engine.config.model.vocab_size
    greedy = SamplingParams(max_tokens=warmup + steps + 8, temperature=0.0, ignore_eos=True)
    seqs = [Sequence(seq_id=1_000_000 + i, token_ids=random_ids(rng, vocab, context + 1), sampling_params=greedy,
                     status=SequenceStatus.RUNNING, block_table=list(range(i * per_seq, (i + 1) * per_seq)),
                     num_computed_tokens=context) for i in range(batch)]
    step = ScheduledBatch(seqs=seqs, num_tokens=[1] * batch)
    t0 = 0.0
    for i in range(warmup + steps):
        if i == warmup:
            sync(runner.device)
            t0 = time.perf_counter()
        sampled = runner.execute(step)
        for s in seqs:
            s.token_ids.append(sampled[s.seq_id].token)
            s.num_computed_tokens += 1
    sync(runner.device)
    seconds = (time.perf_counter() - t0) / steps
    return {"batch": batch, "context": context, "steps": steps, "step_ms": seconds * 1e3,
            "tokens_per_s": batch / seconds, "graph_replays": getattr(runner, "replays", None)}


def fill_cache(llm: LLM, seed: int = 0) -> None:
    """The whole KV cache set to random values (what decode steps over made-up contexts read)."""
    cache = llm.engine.runner.kv_cache
    g = torch.Generator(device=cache.device).manual_seed(seed)
    for layer in range(cache.shape[1]):  # a layer at a time: no cache-sized float32 temporary
        for kv in range(2):
            part = cache[kv, layer]
            part.copy_(torch.randn(part.shape, generator=g, device=cache.device).to(part.dtype))


def run_prompts(llm: LLM, prompts: list[list[int]]) -> tuple[float, list[dict]]:
    """Seconds to every prompt's first token, all added at once (max_tokens=1), and the outputs."""
    sync(llm.engine.runner.device)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), use_tqdm=False)
    sync(llm.engine.runner.device)
    return time.perf_counter() - t0, outs


def prefill_one(llm: LLM, tokens: int, rounds: int, seed: int) -> dict:
    """One prompt of `tokens` fresh random ids (no prefix cached), the best of `rounds`."""
    rng = np.random.default_rng(seed)
    vocab = llm.engine.config.model.vocab_size
    run_prompts(llm, [random_ids(rng, vocab, tokens)])  # warm-up
    times = [run_prompts(llm, [random_ids(rng, vocab, tokens)])[0] for _ in range(rounds)]
    flops = prefill_flops(llm.engine.runner.model, tokens)
    best = min(times)
    return {"tokens": tokens, "rounds": rounds, "seconds": times, "best_s": best, "tflop": flops / 1e12,
            "tflops": flops / best / 1e12}


def prefill_mixed(llm: LLM, lengths: list[int], prefix_share: float, seed: int) -> dict:
    """All prompts of `lengths` added at once, each `max_tokens=1`. With `prefix_share` > 0
    the first share of each prompt (whole blocks) is computed first, untimed, so the timed
    run finds it cached and computes only the rest. Seconds per computed (not cached) token."""
    rng = np.random.default_rng(seed)
    vocab = llm.engine.config.model.vocab_size
    bs = llm.engine.config.cache.block_size
    prompts = [random_ids(rng, vocab, n) for n in lengths]
    if prefix_share > 0:
        run_prompts(llm, [p[:int(len(p) * prefix_share) // bs * bs] for p in prompts if len(p) * prefix_share >= bs])
    seconds, outs = run_prompts(llm, prompts)
    cached = sum(o["num_cached_tokens"] for o in outs)
    new = sum(lengths) - cached
    return {"prompts": len(lengths), "prompt_tokens": sum(lengths), "cached_tokens": cached, "computed_tokens": new,
            "seconds": seconds, "us_per_computed_token": seconds / new * 1e6}


def engine_decode(llm: LLM, batch: int, prompt_len: int, new_tokens: int, seed: int) -> dict:
    """The engine's own steps (scheduler included) for `batch` prompts of `prompt_len`
    fresh ids and `new_tokens` greedy tokens each: the median interval between steps once
    every sequence is decoding, as a client would see its tokens come."""
    engine = llm.engine
    rng = np.random.default_rng(seed)
    vocab = engine.config.model.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    seqs = [engine.new_sequence(random_ids(rng, vocab, prompt_len), params) for _ in range(batch)]
    for s in seqs:
        engine.add(s)
    stamps: list[float] = []
    while engine.has_work():
        engine.step()
        if all(s.num_output_tokens >= 1 for s in seqs):  # every prompt done: the steps from here decode
            stamps.append(time.perf_counter())
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"batch": batch, "prompt_len": prompt_len, "new_tokens": new_tokens, "decode_steps": len(gaps),
            "ms_per_step_median": statistics.median(gaps) * 1e3, "ms_per_step_mean": statistics.fmean(gaps) * 1e3}
