"""Where a single-stream decode step's time goes, part by part, against each part's
weight-streaming bound, measured in the same run.

    python -m benchmarks.decode.parts [--model DIR_OR_GGUF] [--threads 1] [--tokens 64] [--rounds 5]
        [--dtype float32,bfloat16,float32+int8,float32+int4,float32+gguf] [--out results/decode_parts.json]

One request decodes `--tokens` greedy tokens from a 32-token prompt (as
benchmarks/decode/single_stream.py does, whose step time and bound this shares), `--rounds`
times per form, the forms taking turns. Each decode step is one native call
(kernels/csrc/decode_layers_cpu.c), and `DecodeStack.parts` has that call time its parts
back to back: the embedding lookup, the norms, each layer's qkv / o / gate_up (with the
SiLU) / down products, the rotary step with the K/V store, the attention, the lm_head,
the argmax. What the step takes outside the call (scheduling, the inputs' tensors,
sampling, Python) is the step's time less the call's.

Each product part is set against the bytes it streams (the packed weights of all the
layers, as the GEMM reads them: int8 / int4 blocks with their scales) over the read
bandwidth measured in the same round (a streaming read, benchmarks/harness/bandwidth.py), so a part's
"x bound" says how far its kernel is from the memory's pace; the attention is set
against the K and V it reads at the timed steps' mean context. A form is a dtype with an
optional weight quantization after "+", as in single_stream.py. Parts and step times are
medians over the rounds (per step); the bandwidth is the best round's.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch

from benchmarks.harness.paths import REPO

from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from benchmarks.decode.single_stream import decode_ms, kv_bytes, weight_bytes
from benchmarks.harness.bandwidth import stream_read_bandwidth
from pdserve.common import LLM
from pdserve.kernels.cpu_decode import PART_CALLS, PART_TOTAL, PARTS

GEMMS = ("qkv", "o", "gate_up", "down", "lm_head")  # parts that stream a weight


def streamed_bytes(stack) -> dict[str, int]:
    """Bytes each product part reads per step: its packed matrices over all layers."""
    out = {name: sum(getattr(layer, f"{name}_p").nbytes for layer in stack.layers)
           for name in ("qkv", "o", "gate_up", "down")}
    out["lm_head"] = stack.model.head_p.nbytes if stack.has_head else 0
    return out


def timed_round(llm: LLM, stack, tokens: int) -> dict:
    """One request's decode with the stack's parts timed: per-step seconds of each part,
    of the native call and of the whole step."""
    stack.parts = torch.zeros(len(PARTS) + 2, dtype=torch.float64)
    try:
        step_ms = decode_ms(llm, tokens)
        parts = stack.parts.tolist()
    finally:
        stack.parts = None
    calls = int(parts[PART_CALLS])
    if calls == 0:
        raise RuntimeError("no decode step went through the native stack")
    return {"calls": calls, "step_us": step_ms * 1000, "native_us": parts[PART_TOTAL] / calls * 1e6,
            "parts_us": {name: parts[i] / calls * 1e6 for i, name in enumerate(PARTS)}}


def summarize(rounds: list[dict], nbytes: dict[str, int], kv: int, total: int, bandwidth: float) -> dict:
    """Medians over the rounds, each part with its share of the step and, where it streams
    bytes, its pace against the bandwidth; the step against single_stream.py's bound
    (`total` bytes: every weight a step reads, and the K and V)."""
    med = {name: statistics.median(r["parts_us"][name] for r in rounds) for name in PARTS}
    step = statistics.median(r["step_us"] for r in rounds)
    native = statistics.median(r["native_us"] for r in rounds)
    parts = {}
    for name in PARTS:
        row = {"us": med[name], "share": med[name] / step}
        streamed = nbytes.get(name, kv if name == "attention" else 0)
        if streamed:
            bound_us = streamed / bandwidth * 1e6
            row |= {"bytes": streamed, "gb_s": streamed / med[name] / 1e3 if med[name] else None,
                    "bound_us": bound_us, "x_bound": med[name] / bound_us}
        parts[name] = row
    gemm_us = sum(med[g] for g in GEMMS)
    gemm_bytes = sum(nbytes.values())
    whole_bound_us = total / bandwidth * 1e6
    return {"step_us": step, "native_us": native, "outside_us": step - native, "parts": parts,
            "gemms": {"us": gemm_us, "bytes": gemm_bytes, "gb_s": gemm_bytes / gemm_us / 1e3,
                      "x_bound": gemm_us / (gemm_bytes / bandwidth * 1e6)},
            "bound_us": whole_bound_us, "step_x_bound": step / whole_bound_us, "read_gb_s": bandwidth / 1e9}


def print_form(form: str, s: dict) -> None:
    print(f"\n{form}: step {s['step_us']:.0f} us = native call {s['native_us']:.0f} + outside it "
          f"{s['outside_us']:.0f}; bound {s['bound_us']:.0f} us at {s['read_gb_s']:.1f} GB/s -> "
          f"{s['step_x_bound']:.2f}x")
    print(f"  {'part':<11} {'us/step':>8} {'share':>6} {'GB/s':>6} {'x bound':>8}")
    for name, row in s["parts"].items():
        pace = f"{row['gb_s']:6.1f} {row['x_bound']:8.2f}" if "x_bound" in row else ""
        print(f"  {name:<11} {row['us']:8.1f} {row['share']:6.1%} {pace}")
    g = s["gemms"]
    print(f"  {'products':<11} {g['us']:8.1f} {g['us'] / s['step_us']:6.1%} {g['gb_s']:6.1f} {g['x_bound']:8.2f}")
    print(f"  {'outside':<11} {s['outside_us']:8.1f} {s['outside_us'] / s['step_us']:6.1%}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32,bfloat16,float32+int8,float32+int4",
                    help="forms, comma-separated, taking turns: a dtype, '+' a quantization")
    ap.add_argument("--out", default=str(REPO / "results" / "decode_parts.json"))
    args = ap.parse_args(argv)
    if args.tokens < 3 or args.rounds < 1:
        ap.error("--tokens must be at least 3 and --rounds at least 1")
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = resolve_model_dir(None)
    forms = args.dtype.split(",")
    llms = {f: LLM(model, num_threads=args.threads, num_kv_blocks=64, max_model_len=512, dtype=f.partition("+")[0],
                   quantization=f.partition("+")[2] or "none") for f in forms}
    stacks, nbytes, kv, total = {}, {}, {}, {}
    for f, llm in llms.items():
        decode_ms(llm, 8)  # warm-up: kernels built, weights packed, the stack set up
        stack = llm.engine.runner.model.decode_stack()
        if stack is None:
            ap.error(f"{f}: this form's decode steps do not run the native stack (not a CPU float32-activation model?)")
        stacks[f], nbytes[f], kv[f] = stack, streamed_bytes(stack), kv_bytes(llm, args.tokens)
        total[f] = weight_bytes(llm.engine.runner.model) + kv[f]
    rounds: dict[str, list[dict]] = {f: [] for f in forms}
    bandwidth: dict[str, float] = {f: 0.0 for f in forms}
    for _ in range(args.rounds):  # forms in turn, so drift in the machine's load hits all
        for f, llm in llms.items():
            bandwidth[f] = max(bandwidth[f], stream_read_bandwidth(total[f], args.threads, 3))
            rounds[f].append(timed_round(llm, stacks[f], args.tokens))
    by_form = {}
    for f in forms:
        by_form[f] = summarize(rounds[f], nbytes[f], kv[f], total[f], bandwidth[f]) | {"rounds": rounds[f]}
        print_form(f, by_form[f])
    write_report({**run_facts(), "model": str(model), "threads": args.threads, "tokens": args.tokens,
                  "parts": list(PARTS), "by_form": by_form}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
