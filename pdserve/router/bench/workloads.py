"""Benchmark workloads: lists of requests (prompt token ids or text, output length, and for
trace replay the arrival time). Token-id prompts avoid tokenizer round trips."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIRST_ORDINARY_TOKEN = 3  # ids 0-2 are special tokens in models made by `pdserve make-model`


@dataclass
class BenchRequest:
    prompt_token_ids: list[int] | None
    output_len: int
    prompt: str | None = None
    arrival: float | None = None  # seconds from start (trace replay); None: from the arrival process

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids) if self.prompt_token_ids is not None else 0


def _lengths(rng: np.random.Generator, mean: int, range_ratio: float, n: int) -> np.ndarray:
    lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
    return rng.integers(lo, hi + 1, size=n)


def random_workload(n: int, input_len: int, output_len: int, range_ratio: float, vocab: int,
                    seed: int = 0) -> list[BenchRequest]:
    """Independent random prompts; lengths uniform in mean*(1 -/+ range_ratio)."""
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, input_len, range_ratio, n), _lengths(rng, output_len, range_ratio, n)
    return [BenchRequest(rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=int(i)).tolist(), int(o))
            for i, o in zip(ins, outs)]


def shared_prefix_workload(groups: int, prompts_per_group: int, system_len: int, question_len: int,
                           output_len: int, vocab: int, seed: int = 0) -> list[BenchRequest]:
    """`groups` system prompts, each followed by `prompts_per_group` distinct questions; shuffled."""
    rng = np.random.default_rng(seed)
    reqs = []
    for _ in range(groups):
        system = rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=system_len).tolist()
        for _ in range(prompts_per_group):
            q = rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=question_len).tolist()
            reqs.append(BenchRequest(system + q, output_len))
    order = rng.permutation(len(reqs))
    return [reqs[i] for i in order]


def sharegpt_workload(path: str | Path, n: int, tokenizer, output_len: int | None = None, max_len: int = 2048,
                      seed: int = 0) -> list[BenchRequest]:
    """ShareGPT format: a JSON list of {"conversations": [{"from": "human", "value": ...},
    {"from": "gpt", "value": ...}, ...]}. The first human turn is the prompt; the output
    length is the first reply's token count unless `output_len` is given."""
    data = json.loads(Path(path).read_text())
    if not isinstance(data, list):
        raise ValueError(f"{path}: expected a JSON list of conversations")
    rng = np.random.default_rng(seed)
    reqs = []
    for i in rng.permutation(len(data)):
        conv = data[i].get("conversations", []) if isinstance(data[i], dict) else []
        if len(conv) < 2 or conv[0].get("from") != "human":
            continue
        ids = tokenizer.encode(conv[0]["value"])
        out = output_len or len(tokenizer.encode(conv[1].get("value", "")))
        if not ids or out < 1 or len(ids) + out > max_len:
            continue
        reqs.append(BenchRequest(ids, out))
        if len(reqs) == n:
            break
    return reqs


def mooncake_workload(path: str | Path, n: int, scale: int, vocab: int, time_scale: float = 1.0,
                      start: int = 0, max_output: int | None = None, max_input: int | None = None,
                      seed: int = 0) -> list[BenchRequest]:
    """Replay a Mooncake trace scaled down by `scale`: lengths / scale, 512-token hash blocks
    become 512/scale-token blocks, each hash id maps to one fixed random token block (so
    the replay reuses prefixes exactly as the trace does), time / time_scale."""
    block = 512 // scale
    if block < 1:
        raise ValueError(f"scale {scale} leaves blocks of 0 tokens (512/scale must be >= 1)")
    rng = np.random.default_rng(seed)
    blocks: dict[int, list[int]] = {}
    reqs = []
    with open(path) as f:
        rows = [json.loads(line) for _, line in zip(range(start + n), f)][start:]
    t0 = rows[0]["timestamp"] if rows else 0
    for row in rows:
        ids: list[int] = []
        for h in row["hash_ids"]:
            if h not in blocks:
                blocks[h] = rng.integers(FIRST_ORDINARY_TOKEN, vocab, size=block).tolist()
            ids += blocks[h]
        length = max(1, row["input_length"] // scale)
        if max_input:
            length = min(length, max_input)
        out = max(1, row["output_length"] // scale)
        if max_output:
            out = min(out, max_output)
        reqs.append(BenchRequest(ids[:length], out, arrival=(row["timestamp"] - t0) / 1000.0 / time_scale))
    return reqs


def ideal_hit_rate(reqs: list[BenchRequest], block_size: int) -> float:
    """Share of cacheable prompt blocks that an infinite, perfectly routed prefix cache would
    hit: every full block seen before (same chained prefix) is a hit."""
    from pdserve.common.hashing import block_hashes, cacheable_prefix_hashes
    seen: set[int] = set()
    total = hits = 0
    for r in reqs:
        ids = r.prompt_token_ids or []
        hs = cacheable_prefix_hashes(ids, block_size)  # a lookup never matches the final token...
        total += len(hs)
        hits += sum(h in seen for h in hs)
        seen.update(block_hashes(ids, block_size))  # ...but every full block is cached after it
    return hits / total if total else 0.0
