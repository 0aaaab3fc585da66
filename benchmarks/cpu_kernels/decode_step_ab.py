"""A decode step as this tree dispatches it against the same step as another commit's
dispatch code does (default: main), in one process, step by step in ABBA order.

    python -m benchmarks.cpu_kernels.decode_step_ab [--baseline main] [--dtype bfloat16,float32+gguf]
        [--batch 1,8] [--threads 1] [--tokens 100] [--rounds 3]
        [--out results/decode_step_ab.json]

A: this tree. B: the Python the measured bf16 crossover changed (kernels/crossover.py),
as the baseline commit has it -- `LinearPlan.__call__` and `silu_mul` (kernels/__init__.py),
`DecoderForCausalLM.forward`, `decode_logits` and `decode_stack`
(common/models/decoder.py) -- read with `git show` and run as modules beside ours, their
methods put on the live classes for B's steps. The rest (the native library, the decode
stack's C code, the engine) is shared, so the A/B isolates the dispatch. For CPUs without
bf16 dot products (`kernels.bf16_dot_cpu()` False), where the baseline never took torch's
bf16 matmul for decode rows and this tree must not either: it refuses to run elsewhere.

Per `--dtype` (dtype[+quantization]; the model's float32 weights with quantization none
unless given) and `--batch` size: that many sequences of distinct 32-token prompts decode
`--tokens` greedy tokens together; the prefill step is not timed; every decode step is
timed around `engine.step()`, the side switching ABBA; `--rounds` times. Both sides must
give the same tokens (each side run alone once first: checked). Reported: each side's
median step and B / A (> 1: this tree faster), with the steps' count. Default model: the
embedded SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import types

os.environ.setdefault("HF_HUB_OFFLINE", "1")


from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import REPO, RESULTS
from pdserve import kernels
from pdserve.common import LLM, SamplingParams
from pdserve.common.models.decoder import DecoderForCausalLM

SWAPPED = {("pdserve/kernels/__init__.py", "pdserve.kernels", "LinearPlan"): ("__call__", "silu_mul"),
           ("pdserve/common/models/decoder.py", "pdserve.common.models", "DecoderForCausalLM"):
           ("forward", "decode_logits", "decode_stack")}


def baseline_module(rev: str, path: str, package: str) -> types.ModuleType:
    """`path` at commit `rev`, executed as a module of `package` (its relative and
    absolute imports resolve to the live package)."""
    source = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=REPO, check=True, capture_output=True,
                            text=True).stdout
    module = types.ModuleType(f"baseline_{package.replace('.', '_')}")
    module.__package__ = package
    exec(compile(source, f"{rev}:{path}", "exec"), module.__dict__)
    return module


class Sides:
    """The swapped methods of both sides; `use(baseline)` puts one side's on the classes."""

    def __init__(self, rev: str) -> None:
        live = {"LinearPlan": kernels.LinearPlan, "DecoderForCausalLM": DecoderForCausalLM}
        self.methods: dict[bool, list[tuple[type, str, object]]] = {False: [], True: []}
        for (path, package, cls_name), names in SWAPPED.items():
            old = baseline_module(rev, path, package)
            if hasattr(old, "_DECODE_ROWS"):  # one context variable for both: the runner sets the live one
                old._DECODE_ROWS = kernels._DECODE_ROWS
            cls, old_cls = live[cls_name], getattr(old, cls_name)
            for name in names:
                self.methods[False].append((cls, name, cls.__dict__[name]))
                self.methods[True].append((cls, name, old_cls.__dict__[name]))
        # the baseline's plans carried whether they take the bf16 matmul (never, where this runs)
        kernels.LinearPlan._bf16_dot = False
        kernels.LinearPlan._takes_bf16_dot = lambda self, rows: False
        self.baseline = False

    def use(self, baseline: bool) -> None:
        for cls, name, fn in self.methods[baseline]:
            setattr(cls, name, fn)
        self.baseline = baseline


def run(llm: LLM, sides: Sides, batch: int, tokens: int, pattern: str | None
        ) -> tuple[list[list[int]], dict[bool, list[float]]]:
    """`batch` sequences decoded together; `pattern` None: every step on the present side,
    else the side per step by "ABBA" (A this tree)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    seqs = [engine.new_sequence([(7 * i + j) % 500 + 10 for j in range(32)], params) for i in range(batch)]
    for s in seqs:
        engine.add(s)
    engine.step()  # the prefill and the first tokens
    times: dict[bool, list[float]] = {True: [], False: []}
    i = 0
    while engine.has_work():
        if pattern is not None:
            sides.use(pattern[i % len(pattern)] == "B")
        t = time.perf_counter()
        engine.step()
        times[sides.baseline].append(time.perf_counter() - t)
        i += 1
    return [list(s.output_token_ids) for s in seqs], times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default="main", help="the commit whose dispatch is B")
    ap.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16,float32+gguf")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "decode_step_ab.json"))
    args = ap.parse_args()
    if kernels.bf16_dot_cpu():
        sys.exit("this CPU has bf16 dot products: the A/B is for chips where neither side takes them")
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = resolve_model_dir(None)
    sides = Sides(args.baseline)
    cases = {}
    for dt in args.dtype.split(","):
        dtype, _, quantization = dt.partition("+")
        llm = LLM(model, num_threads=args.threads, num_kv_blocks=256, max_model_len=512, dtype=dtype,
                  quantization=quantization or "none", enable_prefix_caching=False)
        for batch in (int(b) for b in args.batch.split(",")):
            tokens = {}
            for side in (False, True):  # warm-up, and the tokens each side gives alone
                sides.use(side)
                tokens[side] = run(llm, sides, batch, args.tokens, None)[0]
            if tokens[False] != tokens[True]:
                raise SystemExit(f"{dt}, batch {batch}: this tree and {args.baseline} gave different tokens")
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.rounds):
                for side, ts in run(llm, sides, batch, args.tokens, "ABBA")[1].items():
                    times[side] += ts
            sides.use(False)
            ours, base = (statistics.median(times[s]) * 1000 for s in (False, True))
            cases[f"{dt} batch {batch}"] = {"this_ms": ours, "baseline_ms": base, "baseline_over_this": base / ours,
                                            "steps_each": len(times[False]), "same_tokens": True}
            print(f"{dt}, batch {batch}: this tree {ours:.3f} ms/step, {args.baseline} {base:.3f} ms/step, "
                  f"{args.baseline} / this {base / ours:.3f} ({len(times[False])} steps each, "
                  f"load {os.getloadavg()[0]:.2f})", flush=True)
    write_report({**run_facts(), "model": str(model), "baseline": args.baseline, "threads": args.threads,
                  "tokens": args.tokens, "rounds": args.rounds, "cases": cases}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
