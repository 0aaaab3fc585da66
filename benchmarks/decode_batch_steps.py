"""Pure decode steps at several batch sizes: the median time of one `LLM.engine.step` once
every sequence of the batch is past its prompt.

    python benchmarks/decode_batch_steps.py [--repo DIR] [--model DIR] [--threads 2]
        [--batches 1,8,16,32] [--tokens 40] [--out results/decode_batch_steps.json]

`--repo` times another checkout of pdserve (a `git worktree` of an earlier commit) with
this script, so that two commits can be compared run after run on the same machine:

    git worktree add /tmp/before HEAD~1
    for i in 1 2; do python benchmarks/decode_batch_steps.py --repo /tmp/before; \\
        python benchmarks/decode_batch_steps.py; done

Each batch: `--batches` sequences of 32 distinct prompt tokens, `--tokens` greedy tokens
each (ignore_eos), added at once; the first 3 steps (the prompts' prefill) are left out
and the median of the rest is reported. Default model: the embedded SmolLM2-135M-Instruct
at its default precision (the GGUF's Q4_1 linears).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="the pdserve checkout to time")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batches", default="1,8,16,32")
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sys.path.insert(0, args.repo)
    import torch
    from pdserve.common import LLM, SamplingParams
    torch.set_num_threads(args.threads)
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = str(resolve_model_dir(None))
    llm = LLM(model, num_threads=args.threads, max_model_len=512, enable_prefix_caching=False)
    engine, steps = llm.engine, {}
    for batch in (int(b) for b in args.batches.split(",")):
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True, temperature=0)
        for i in range(batch):
            engine.add(engine.new_sequence([100 + 7 * i + j for j in range(32)], params))
        times = []
        while engine.has_work():
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        decode = sorted(times[3:])
        steps[batch] = decode[len(decode) // 2] * 1e3
    print(args.repo, " ".join(f"batch {b}: {ms:.1f} ms" for b, ms in steps.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"repo": args.repo, "model": model, "threads": args.threads,
                                              "median_step_ms": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
