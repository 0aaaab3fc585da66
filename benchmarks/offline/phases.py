"""Where the offline workload's time goes, per dtype: steps that prefill against pure
decode steps, and the decode steps by batch rows, dtypes taking turns in one process.

    python -m benchmarks.offline.phases [--model DIR] [--num-prompts 16] [--dtype float32,bfloat16]
        [--rounds 2] [--threads 2] [--out results/offline_phases.json]

The workload is benchmarks/offline/throughput.py's (random token-id prompts of 32-512
tokens, 16-256 output tokens each, greedy, ignore_eos; the engine settings of its pdserve
child, prefix caching off so that every round prefills every prompt). One engine per
dtype; each round runs `LLM.generate` on the whole workload with each engine in turn, and
every `ModelRunner.execute` call is timed: a step with any prompt tokens counts as
prefill (chunks of 2048 tokens, decodes riding along), the others as decode steps of
their row count. Reported per dtype: wall seconds (median round), the prefill and decode
seconds, and per decode row count its steps and best / median step time, with the first
dtype's best over each other dtype's best per row count. Per-step bests
are what a quiet machine gives; a loaded one shows as steps far above the best (an
OpenMP barrier waiting on a thread the kernel took off its core).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict

import torch

from benchmarks.harness.paths import REPO

from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from pdserve.common import LLM, SamplingParams
from benchmarks.harness.models import ensure_model
from benchmarks.offline.throughput import BLOCK_SIZE, MAX_MODEL_LEN, kv_blocks_for, make_workload


class StepLog:
    """Wraps an engine's `runner.execute`: (decode rows, prompt tokens, seconds) per step."""

    def __init__(self, llm: LLM) -> None:
        self.steps: list[tuple[int, int, float]] = []
        runner = llm.engine.runner
        inner = runner.execute

        def execute(batch, layer_hook=None):
            t0 = time.perf_counter()
            out = inner(batch, layer_hook)
            rows = sum(1 for c in batch.num_tokens if c == 1)
            self.steps.append((rows, sum(c for c in batch.num_tokens if c != 1), time.perf_counter() - t0))
            return out

        runner.execute = execute


def one_round(llm: LLM, log: StepLog, work) -> dict:
    """One timed `generate` of the workload: wall, prefill and decode seconds, decode steps by rows."""
    log.steps.clear()
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    t0 = time.perf_counter()
    llm.generate(work.prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    by_rows: dict[int, list[float]] = defaultdict(list)
    for rows, prompt, s in log.steps:
        if not prompt:
            by_rows[rows].append(s)
    return {"wall_s": wall, "tokens_per_s": work.total_output / wall,
            "prefill_s": sum(s for _, p, s in log.steps if p),
            "decode_s": sum(s for _, p, s in log.steps if not p), "decode_by_rows": dict(by_rows)}


def summarize(rounds: list[dict]) -> dict:
    med = sorted(rounds, key=lambda r: r["wall_s"])[(len(rounds) - 1) // 2]
    rows: dict[int, list[float]] = defaultdict(list)
    for r in rounds:
        for m, ss in r["decode_by_rows"].items():
            rows[m].extend(ss)
    return {"median_round": {k: v for k, v in med.items() if k != "decode_by_rows"},
            "decode_rows": {m: {"steps": len(ss), "best_ms": min(ss) * 1e3, "median_ms": statistics.median(ss) * 1e3}
                            for m, ss in sorted(rows.items())}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir (default: the small qwen3 of offline_throughput.py)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--dtype", default="float32,bfloat16", help="engine dtypes, comma-separated, alternated")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "results" / "offline_phases.json"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = ensure_model(args.model)
    work = make_workload(args.num_prompts, json.loads((model / "config.json").read_text())["vocab_size"], args.seed)
    dtypes = args.dtype.split(",")
    blocks = max(kv_blocks_for(work), MAX_MODEL_LEN // BLOCK_SIZE + 1)  # and room for one sequence of max_model_len
    llms = {dt: LLM(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=64, max_num_batched_tokens=2048,
                    block_size=BLOCK_SIZE, num_kv_blocks=blocks, num_threads=args.threads, dtype=dt,
                    enable_prefix_caching=False)  # every round prefills the whole workload again
            for dt in dtypes}
    logs = {dt: StepLog(llm) for dt, llm in llms.items()}
    for llm in llms.values():  # warm-up: kernels built, weights packed
        llm.generate([p[:64] for p in work.prompts[:2]], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                     use_tqdm=False)
    rounds: dict[str, list[dict]] = {dt: [] for dt in dtypes}
    for _ in range(args.rounds):
        for dt in dtypes:
            rounds[dt].append(one_round(llms[dt], logs[dt], work))
    by_dtype = {dt: summarize(rs) for dt, rs in rounds.items()}
    for dt, s in by_dtype.items():
        r = s["median_round"]
        print(f"{dt}: {r['tokens_per_s']:.1f} tok/s; wall {r['wall_s']:.2f} s = prefill steps {r['prefill_s']:.2f} s "
              f"+ decode steps {r['decode_s']:.2f} s + the rest {r['wall_s'] - r['prefill_s'] - r['decode_s']:.2f} s")
        print("  decode step ms by rows (best / median): " + "  ".join(
            f"{m}: {v['best_ms']:.1f}/{v['median_ms']:.1f}" for m, v in s["decode_rows"].items()))
    base = by_dtype[dtypes[0]]["decode_rows"]
    for dt in dtypes[1:]:
        other = by_dtype[dt]["decode_rows"]
        print(f"{dtypes[0]} / {dt}, best decode step by rows: " + "  ".join(
            f"{m}: {base[m]['best_ms'] / other[m]['best_ms']:.2f}" for m in base if m in other))
    write_report({**run_facts(), "model": str(model), "threads": args.threads, "num_prompts": args.num_prompts,
                  "total_output_tokens": work.total_output, "rounds": rounds, "by_dtype": by_dtype}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
