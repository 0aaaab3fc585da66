"""What the sampling features cost, unused and used, against another commit, in one run.

    python -m benchmarks.offline.feature_cost --baseline /path/to/other-checkout [--model DIR]
        [--prompts 8] [--tokens 32] [--rounds 5] [--out results/feature_cost.json]

Two long-lived engine processes, one per checkout (this one and `--baseline`, each run
with its own tree on `PYTHONPATH`), one thread each, the same model at float32, take
turns round by round on the same batch: `--prompts` fixed prompts of 32 tokens, each
decoding `--tokens` greedy tokens (ignore_eos). Each turn reports the process CPU seconds
and wall seconds of the `generate` call; the figure is CPU milliseconds per generated
token (CPU time, unlike wall time, does not count the time the process waited for a core
on a shared machine). The unused-feature cost is this checkout's median over the
baseline's (target: <= 1.02). Then, in this checkout only, the same batch with one
feature on at a time (logprobs, penalties, logit_bias + min_p, a JSON grammar, prompt
logprobs, n = 2), each over plain in the same alternation.

The baseline must accept `LLM(model, num_threads=...)` and `SamplingParams(max_tokens,
temperature, ignore_eos)`: any commit since the engine sub-package (b925007) does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from benchmarks.harness.child import JsonChild
from benchmarks.harness.paths import REPO

from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report

FEATURES = {  # name -> SamplingParams keyword arguments on top of the plain ones
    "plain": {},
    "logprobs_5": {"logprobs": 5},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1},
    "bias_min_p": {"logit_bias": {11: -5.0, 13: 2.0}, "min_p": 0.05},
    "json_object": {"structured": ("json_object", "")},
    "prompt_logprobs_1": {"prompt_logprobs": 1},
    "n_2": {"n": 2},
}

CHILD = r"""
import json, os, sys, time
os.environ.setdefault("HF_HUB_OFFLINE", "1")
import torch
torch.set_num_threads(1)
from pdserve.common import LLM, SamplingParams
model, prompts, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
try:
    llm = LLM(model, num_threads=1, dtype="float32", max_model_len=512)
except TypeError:
    llm = LLM(model, num_threads=1, max_model_len=512)
batch = [[(7 * i + 3 * j) % 500 + 10 for j in range(32)] for i in range(prompts)]

def params(extra):
    if "structured" in extra:
        from pdserve.common.sampling_params import StructuredOutput
        extra = {**extra, "structured": StructuredOutput(*extra["structured"])}
    return SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True, **extra)

llm.generate(batch, params({}), use_tqdm=False)  # warm: kernels built, weights packed
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    extra = json.loads(line)
    sp = params(extra)
    c0, w0 = time.process_time(), time.perf_counter()
    out = llm.generate(batch, sp, use_tqdm=False)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    n = sum(len(o["token_ids"]) if "outputs" not in o else sum(len(c["token_ids"]) for c in o["outputs"])
            for o in out)
    print(json.dumps({"cpu_s": cpu, "wall_s": wall, "tokens": n}), flush=True)
"""


class Engine(JsonChild):
    """One checkout's engine process, driven a turn at a time over stdin/stdout."""

    def __init__(self, checkout: Path, model: str, prompts: int, tokens: int) -> None:
        super().__init__(sys.executable, CHILD, [model, str(prompts), str(tokens)], 1, cwd=str(checkout),
                         env={"PYTHONPATH": str(checkout)})

    def turn(self, extra: dict) -> dict:
        return self.ask(extra)


def cpu_ms_per_token(turns: list[dict]) -> float:
    return statistics.median(t["cpu_s"] / t["tokens"] * 1000 for t in turns)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="a checkout of the commit to compare with (a git worktree)")
    ap.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "results" / "feature_cost.json"))
    args = ap.parse_args()
    ours = Engine(REPO, args.model, args.prompts, args.tokens)
    base = Engine(Path(args.baseline).resolve(), args.model, args.prompts, args.tokens)
    turns: dict[str, list[dict]] = {"baseline": [], **{name: [] for name in FEATURES}}
    try:
        for _ in range(args.rounds):
            turns["baseline"].append(base.turn({}))
            for name, extra in FEATURES.items():
                turns[name].append(ours.turn(extra))
    finally:
        ours.close()
        base.close()
    ms = {name: cpu_ms_per_token(t) for name, t in turns.items()}
    report = {**run_facts(), "model": args.model, "prompts": args.prompts, "tokens": args.tokens, "rounds": args.rounds,
              "baseline": str(Path(args.baseline).resolve()), "cpu_ms_per_token": ms,
              "unused_over_baseline": ms["plain"] / ms["baseline"],
              "used_over_plain": {name: ms[name] / ms["plain"] for name in FEATURES if name != "plain"},
              "turns": turns}
    print(f"CPU ms per generated token (median of {args.rounds}): baseline {ms['baseline']:.3f}, "
          f"this checkout {ms['plain']:.3f} -> unused features cost {report['unused_over_baseline']:.3f}x")
    for name, ratio in report["used_over_plain"].items():
        print(f"  {name:18s} {ms[name]:8.3f} ms/token  {ratio:.3f}x plain")
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
