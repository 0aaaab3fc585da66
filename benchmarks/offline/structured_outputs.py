"""Per-step cost of structured output (common/engine/grammar.py): constrained against
unconstrained decoding, side by side in one process, taking turns.

    python -m benchmarks.offline.structured_outputs [--model DIR] [--batch 1,8,32] [--steps 200]
        [--e2e-requests 8] [--out results/structured_outputs.json]

1. The sampling step alone: logits [B, V] (random, the model's vocabulary) -> tokens,
   plain vs every row under a JSON schema (bitmask fill per row, mask applied, sample,
   matcher advanced). Reports microseconds per step and the ratio.
2. End to end: the offline engine decoding the same chat prompts greedily, plain vs under
   the same schema; reports milliseconds per output token and the ratio (the forward is
   the same, so the difference is the grammar's).
Default model: the default SmolLM2 (its 49k-token vocabulary is the realistic case).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.harness.paths import REPO

from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.grammar import Grammars
from pdserve.common.engine.sampler import Sampler
from pdserve.common.engine.sequence import Sequence
from pdserve.common.sampling_params import StructuredOutput

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string"}},
                                           "age": {"type": "integer"}},
          "required": ["name", "tags", "age"], "additionalProperties": False}
PROMPTS = ["Give me a person as JSON with a name, tags and an age.", "Describe a cat as JSON.",
           "A JSON record for a city.", "Invent a user profile in JSON."]


def sampler_steps(model_dir: Path, vocab: int, eos: list[int], batch: int, steps: int, constrained: bool) -> float:
    """Mean microseconds per sampling step of `batch` rows (best of 3 rounds)."""
    grammars = Grammars(model_dir, vocab)
    grammars.stop_token_ids = eos
    sampler = Sampler(0)
    so = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    # greedy: the sampling itself is the same either way; the grammar's cost is what differs
    params = SamplingParams(temperature=0, max_tokens=10**6, structured=so)
    gen = torch.Generator().manual_seed(0)
    all_logits = torch.randn(steps, batch, vocab, generator=gen)  # made before the clock starts
    rounds = []
    for _ in range(3):
        seqs = [Sequence(i, [1], params) for i in range(batch)]
        t0 = time.perf_counter()
        for step in range(steps):
            logits = all_logits[step]
            bitmask = grammars.bitmask(seqs) if constrained else None
            tokens = sampler(logits, [s.sampling_params for s in seqs], [None] * batch, bitmask=bitmask)
            for i, (s, t) in enumerate(zip(seqs, tokens)):
                s.token_ids.append(t)
                if constrained and grammars.is_complete(s):  # start that row's document again
                    seqs[i] = Sequence(s.seq_id, [1], params)
        rounds.append((time.perf_counter() - t0) / steps * 1e6)
    return min(rounds)


def end_to_end(llm: LLM, n: int, max_tokens: int, constrained: bool) -> tuple[float, int]:
    """(ms per output token, output tokens) of `n` greedy chat requests in one batch."""
    so = StructuredOutput("json", json.dumps(SCHEMA)) if constrained else None
    prompts = [f"<|im_start|>user\n{PROMPTS[i % len(PROMPTS)]}<|im_end|>\n<|im_start|>assistant\n" for i in range(n)]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=not constrained, structured=so)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    tokens = sum(len(o["token_ids"]) for o in outs)
    return (time.perf_counter() - t0) / tokens * 1e3, tokens


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HuggingFace-format model dir (default: the default SmolLM2)")
    ap.add_argument("--batch", default="1,8,32")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--e2e-requests", type=int, default=8)
    ap.add_argument("--e2e-max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "results" / "structured_outputs.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.model is None:
        from pdserve.common.loading.default_model import default_model_dir
        model_dir = Path(default_model_dir())
    else:
        model_dir = Path(args.model)
    llm = LLM(str(model_dir), num_kv_blocks=512, max_model_len=1024)
    vocab = llm.engine.config.model.vocab_size
    eos = sorted(llm.engine.eos_token_ids)
    result: dict = {"model": str(model_dir), "vocab": vocab, "schema": SCHEMA, "sampler": [], "end_to_end": {}}
    print(f"sampling step, vocabulary {vocab}: plain vs JSON schema (us per step)")
    for b in (int(x) for x in args.batch.split(",")):
        plain = sampler_steps(model_dir, vocab, eos, b, args.steps, False)
        guided = sampler_steps(model_dir, vocab, eos, b, args.steps, True)
        result["sampler"].append({"batch": b, "plain_us": plain, "constrained_us": guided, "ratio": guided / plain})
        print(f"  batch {b:3d}: plain {plain:9.1f}  constrained {guided:9.1f}  ratio {guided / plain:5.2f}x")
    end_to_end(llm, 2, 8, True)  # warm-up: compile the grammar, load xgrammar
    runs: dict[str, list[float]] = {"plain": [], "constrained": []}
    counts: dict[str, int] = {}
    for _ in range(3):  # taking turns
        for name in runs:
            ms, tokens = end_to_end(llm, args.e2e_requests, args.e2e_max_tokens, name == "constrained")
            runs[name].append(ms)
            counts[name] = tokens
    plain, guided = statistics.median(runs["plain"]), statistics.median(runs["constrained"])
    result["end_to_end"] = {"requests": args.e2e_requests, "ms_per_token": {k: statistics.median(v) for k, v in runs.items()},
                            "output_tokens": counts, "ratio": guided / plain, "runs": runs}
    print(f"end to end, {args.e2e_requests} greedy requests: plain {plain:.2f} ms/token, "
          f"constrained {guided:.2f} ms/token, ratio {guided / plain:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
