"""A decode step with the lm_head in the native stack's call against the same step with it
apart, in one process, step by step in ABBA order (so drift in the machine's load hits
both alike).

    python -m benchmarks.decode.head_ab [--dtype float32+int8,float32+int4,float32+gguf] [--threads 1]
        [--tokens 200] [--rounds 3] [--out results/decode_head_ab.json]

fused: `ModelRunner.execute` takes `DecoderForCausalLM.decode_logits` (token ids to the
logits and each row's argmax in one call; greedy rows take that argmax); apart: the same
engine with `decode_logits` turned off, so the step runs the stack to the final norm, the
lm_head's own call and numpy's argmax. One request decodes `--tokens` greedy tokens from a
32-token prompt, `--rounds` times; every step is timed around `engine.step()`; the report
gives each side's median and apart / fused (> 1: the fused step is faster). Both sides
must give the same tokens (checked).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.harness.paths import REPO

from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from pdserve.common import LLM, SamplingParams
from pdserve.common.models.decoder import DecoderForCausalLM

PROMPT = list(range(10, 42))


class Toggle:
    """`decode_logits` on every model instance, on or off by `fused`."""

    def __init__(self) -> None:
        self.fused = True
        real = DecoderForCausalLM.decode_logits
        DecoderForCausalLM.decode_logits = lambda model, *a: real(model, *a) if self.fused else None


def run(llm: LLM, toggle: Toggle, tokens: int, pattern: str | None) -> tuple[list[int], dict[bool, list[float]]]:
    """One request's decode; `pattern` None: every step on toggle's present side, else the
    side per step by "ABBA" (A fused)."""
    engine = llm.engine
    seq = engine.new_sequence(PROMPT, SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    engine.add(seq)
    engine.step()  # the prefill and the first token
    times: dict[bool, list[float]] = {True: [], False: []}
    i = 0
    while engine.has_work():
        if pattern is not None:
            toggle.fused = pattern[i % len(pattern)] == "A"
        t = time.perf_counter()
        engine.step()
        times[toggle.fused].append(time.perf_counter() - t)
        i += 1
    return list(seq.output_token_ids), times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="float32+int8,float32+int4,float32+gguf")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "results" / "decode_head_ab.json"))
    args = ap.parse_args()
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = resolve_model_dir(None)
    toggle = Toggle()
    by_dtype = {}
    for dt in args.dtype.split(","):
        llm = LLM(model, num_threads=args.threads, num_kv_blocks=64, max_model_len=512, dtype=dt.partition("+")[0],
                  quantization=dt.partition("+")[2] or "none")
        tokens = {}
        for side in (True, False):  # warm-up, and the tokens each side gives alone
            toggle.fused = side
            tokens[side] = run(llm, toggle, args.tokens, None)[0]
        if tokens[True] != tokens[False]:
            raise SystemExit(f"{dt}: the fused and the apart steps gave different tokens")
        times: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for side, ts in run(llm, toggle, args.tokens, "ABBA")[1].items():
                times[side] += ts
        fused, apart = (statistics.median(times[s]) * 1000 for s in (True, False))
        by_dtype[dt] = {"fused_ms": fused, "apart_ms": apart, "apart_over_fused": apart / fused,
                        "steps_each": len(times[True])}
        print(f"{dt}: fused {fused:.3f} ms/step, apart {apart:.3f} ms/step, apart / fused {apart / fused:.3f} "
              f"({len(times[True])} steps each, load {os.getloadavg()[0]:.2f})")
        toggle.fused = True
    write_report({**run_facts(), "model": str(model), "threads": args.threads, "tokens": args.tokens,
                  "rounds": args.rounds, "by_dtype": by_dtype}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
