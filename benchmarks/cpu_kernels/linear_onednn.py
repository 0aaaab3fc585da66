"""pdserve's bf16 and int8 linears against torch's own (oneDNN's bf16 `F.linear`, torch's
int8 products), per weight shape and row count, on the CPU at hand: one process, the
contestants alternating pass by pass.

    python -m benchmarks.cpu_kernels.linear_onednn [--model DIR] [--rows 1,2,4,8,16,32,64,256,512]
        [--threads 2] [--repeats 5] [--stream-mb 64] [--head]
        [--out docs/results/kernels/cpu_linear_onednn_<cpu>.json]

Shapes: one decoder layer's four matrices (q/k/v, o, gate/up, down; `--head`: the lm_head
too) of the model (default: SmolLM2-135M's shapes, as benchmarks/cpu_linear_bf16.py).
Rows: decode batches up to 64, then prompt-chunk sizes. Up to 64 rows each contestant
runs over enough copies of the weight (`--stream-mb` of its own form) that the copies
stream from memory as a decode step's weights do; past that over one copy (the product
is bound by arithmetic). Contestants, float32 activations in and out unless said:

  bf16 weights
    pdserve_bf16        `kernels.LinearPlan` as the engine runs it: the native widened-bf16
                        tile, or torch's bf16 matmul from the shape's measured crossover
                        where the CPU has bf16 dot products (`kernels.crossover`)
    native_bf16_tile    the native tile alone (`cpu_native.gemm` on bf16 panels)
    onednn_bf16         `F.linear(x, w)` with x and w bf16 (x converted before the clock):
                        torch's bf16 matmul, what vLLM's CPU backend runs
    onednn_bf16_packed  oneDNN on its own prepacked bf16 weight (`torch.ops.mkldnn`; needs
                        AVX-512 or AVX-NE-CONVERT: absent elsewhere)
  int8 weights (the same weight quantized)
    pdserve_int8_decode Q8_0 (a float16 scale per 32 inputs) by int8 dot products, the
                        engine's product for decode rows (`kernels.decode_rows`)
    pdserve_int8_decode_maddubs  the same on AVX2's maddubs, where the library runs VNNI's
                        vpdpbusd (`cpu_native.qdot_variant()`; the same bits): their A/B
    pdserve_int8_prompt Q8_0 as a prompt chunk's rows take it (the dequantizing tile past
                        `quant.QDOT_ROWS`)
    torch_int8_weight   `torch._weight_int8pack_mm`: int8 weight, a scale per output
                        channel, bf16 activations (converted before the clock)
    torch_int8_dynamic  `torch.ao.nn.quantized.dynamic.Linear` (the x86 engine: fbgemm /
                        oneDNN, VNNI or AMX-int8 where present): int8 weight per channel,
                        activations quantized per tensor on the fly

torch's int8 forms scale per output channel, not per 32 inputs: they are other weights than
a Q8_0 file's (the `max_rel_err` column says how far each result is from float64 on its
own weight's float form). Reported per shape and row count: each contestant's best pass
(ms per product, GFLOP/s), and pdserve_bf16 / onednn_bf16 and pdserve_int8_decode /
torch_int8_dynamic time ratios (< 1: pdserve faster). The JSON also records the chip
(model and SIMD flags), torch's version, the thread count and the crossovers pdserve
measured.
"""
from __future__ import annotations

import argparse
import math
import re
import sys
import time
from typing import Callable

import torch
import torch.nn.functional as F


from benchmarks.cpu_kernels.cpu_linear_bf16 import model_config
from benchmarks.harness.facts import cpu_facts, run_facts
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import DOCS_RESULTS
from pdserve import kernels
from pdserve.kernels import cpu_native, crossover, quant

STREAMED_ROWS = 64  # up to this many rows the weights stream from memory (copies)


def layer_shapes(cfg: dict, head: bool) -> list[tuple[str, int, int]]:
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    shapes = [("qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("o", hidden, heads * head_dim),
              ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]
    return shapes + ([("lm_head", cfg["vocab_size"], hidden)] if head else [])


class Contestant:
    """One way to multiply: `make(w)` prepares a float32 weight [n, k] in its form and
    returns (product of x [m, k] float32, the float32 weight it multiplies by, its bytes);
    `prep(x)` converts x before the clock starts."""

    def __init__(self, name: str, make: Callable, prep: Callable[[torch.Tensor], torch.Tensor] = lambda x: x,
                 decode: bool = False, qdot_variant: int | None = None) -> None:
        self.name, self.make, self.prep, self.decode = name, make, prep, decode
        self.qdot_variant = qdot_variant  # the int8 dot products it runs (cpu_native.QDOT_VARIANTS); None: as loaded


def bf16_plan(w):
    wb = w.to(torch.bfloat16)
    return kernels.LinearPlan(wb), wb.float(), wb.numel() * 2


def bf16_tile(w):
    wb = w.to(torch.bfloat16)
    packed, n = cpu_native.pack_weight(wb), w.shape[0]
    return (lambda x: cpu_native.gemm(x, packed, n)), wb.float(), wb.numel() * 2


def onednn_bf16(w):
    wb = w.to(torch.bfloat16)
    return (lambda x: F.linear(x, wb)), wb.float(), wb.numel() * 2


def onednn_bf16_packed(w):
    wb = w.to(torch.bfloat16)
    packed = torch.ops.mkldnn._reorder_linear_weight(wb, STREAMED_ROWS)  # RuntimeError without AVX-512 / NE-CONVERT
    return (lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")), wb.float(), wb.numel() * 2


def q8_plan(w):
    q = quant.quantize(w, "q8_0")
    plan = kernels.LinearPlan(w.new_empty((0, w.shape[1])), quant=q)  # the engine's placeholder weight
    assert plan.native, "the quantized weight did not take the native path"
    return plan, quant.dequantize(q), q.nbytes


def per_channel_int8(w):
    scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [n]
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def torch_int8_weight(w):
    q, scale = per_channel_int8(w)
    s = scale.to(torch.bfloat16)
    return (lambda x: torch._weight_int8pack_mm(x, q, s)), q.float() * s.float()[:, None], q.numel()


def torch_int8_dynamic(w):
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    lin = DynamicLinear(w.shape[1], w.shape[0], bias_=False, dtype=torch.qint8)
    lin.set_weight_bias(torch.quantize_per_channel(w, (w.abs().amax(1) / 127).clamp_min(1e-12).double(),
                                                   torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8), None)
    return lin, lin.weight().dequantize(), w.numel()


def to_bf16(x):
    return x.to(torch.bfloat16)


CONTESTANTS = [
    Contestant("pdserve_bf16", bf16_plan), Contestant("native_bf16_tile", bf16_tile),
    Contestant("onednn_bf16", onednn_bf16, to_bf16), Contestant("onednn_bf16_packed", onednn_bf16_packed, to_bf16),
    Contestant("pdserve_int8_decode", q8_plan, decode=True),
    Contestant("pdserve_int8_decode_maddubs", q8_plan, decode=True, qdot_variant=0),
    Contestant("pdserve_int8_prompt", q8_plan),
    Contestant("torch_int8_weight", torch_int8_weight, to_bf16), Contestant("torch_int8_dynamic", torch_int8_dynamic),
]


def run_pass(fns: list, x: torch.Tensor, c: Contestant) -> float:
    lib = cpu_native.library()
    loaded = lib.pd_qdot_variant()
    if c.qdot_variant is not None:
        lib.pd_qdot_set_variant(c.qdot_variant)
    try:
        with kernels.decode_rows(c.decode):
            t0 = time.perf_counter()
            for fn in fns:
                fn(x)
            return (time.perf_counter() - t0) / len(fns)
    finally:
        lib.pd_qdot_set_variant(loaded)


def max_rel_err(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = F.linear(x.double(), w.double())
    return float((y.double() - ref).abs().max() / ref.abs().max())


def bench_shape(name: str, n: int, k: int, rows: list[int], args, g: torch.Generator) -> list[dict]:
    w = torch.randn(n, k, generator=g) / k ** 0.5
    forms, skipped = {}, {}
    for c in CONTESTANTS:
        if c.qdot_variant is not None and cpu_native.library().pd_qdot_variant() == c.qdot_variant:
            continue  # the loaded variant already: pdserve_int8_decode is it
        try:
            fn, wf, nbytes = c.make(w)
        except (RuntimeError, ValueError) as e:
            skipped[c.name] = str(e).splitlines()[0]
            continue
        copies = max(1, math.ceil(args.stream_mb * 2 ** 20 / nbytes))
        forms[c] = ([fn] + [c.make(w)[0] for _ in range(copies - 1)], wf, nbytes)
    out = []
    for m in rows:
        x = torch.randn(m, k, generator=g)
        xs = {c: c.prep(x) for c in forms}
        fns = {c: fs if m <= STREAMED_ROWS else fs[:1] for c, (fs, _, _) in forms.items()}
        errs = {}
        for c in forms:  # warm-up (oneDNN builds its primitive for the shape) and the check
            with kernels.decode_rows(c.decode):
                y = fns[c][0](xs[c])
            errs[c.name] = max_rel_err(y.float(), x, forms[c][1])
        best = {c.name: float("inf") for c in forms}
        for r in range(args.repeats):
            order = list(forms) if r % 2 == 0 else list(reversed(forms))
            for c in order:
                best[c.name] = min(best[c.name], run_pass(fns[c], xs[c], c))
        flop = 2 * m * n * k
        row = {"shape": name, "n": n, "k": k, "rows": m, "copies": {c.name: len(f) for c, f in fns.items()},
               "ms": {c: t * 1e3 for c, t in best.items()}, "gflops": {c: flop / t / 1e9 for c, t in best.items()},
               "max_rel_err": errs, "skipped": skipped}
        for a, b in (("pdserve_bf16", "onednn_bf16"), ("pdserve_int8_decode", "torch_int8_dynamic")):
            if a in best and b in best:
                row[f"{a}/{b}"] = best[a] / best[b]
        out.append(row)
        print(f"{name:>8} [{n:>5}, {k:>5}] {m:>4} rows  " + "  ".join(
            f"{c} {t * 1e3:.3f}" for c, t in best.items()), flush=True)
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,2,4,8,16,32,64,256,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--stream-mb", type=float, default=64.0, help="each form's weight copies up to 64 rows")
    ap.add_argument("--head", action="store_true", help="also the lm_head")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if cpu_native.library() is None:
        sys.exit("the native kernels did not build (is a C compiler installed?)")
    torch.set_num_threads(args.threads)
    cfg = model_config(args.model)
    rows = [int(r) for r in args.rows.split(",")]
    g = torch.Generator().manual_seed(0)
    shapes = layer_shapes(cfg, args.head)
    results = [r for name, n, k in shapes for r in bench_shape(name, n, k, rows, args, g)]
    cpu = cpu_facts()
    report = {**run_facts(), "threads": args.threads, "torch": torch.__version__,
              "bf16_dot_cpu": kernels.bf16_dot_cpu(), "qdot_variant": cpu_native.qdot_variant(), "repeats": args.repeats, "stream_mb": args.stream_mb,
              "crossovers": {f"{name} [{n}, {k}]": kernels.LinearPlan(torch.zeros(n, k, dtype=torch.bfloat16)).bf16_rows
                             for name, n, k in shapes},
              "never": crossover.NEVER, "results": results}
    slug = re.sub(r"[^a-z0-9]+", "_", cpu.get("model", "cpu").lower()).strip("_")
    write_report(report, args.out or DOCS_RESULTS / "kernels" / f"cpu_linear_onednn_{slug}.json")


if __name__ == "__main__":
    main()
