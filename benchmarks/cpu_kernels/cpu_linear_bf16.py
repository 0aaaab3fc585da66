"""bf16 against float32 packed weights in the native CPU GEMM (kernels/csrc/gemm_cpu.c):
every linear of a model's forward pass (each layer's q/k/v, o, gate/up, down, and the
lm_head), as distinct matrices so that the weights stream from memory as in a decode step,
float32 activations in both, alternating in one process.

    python -m benchmarks.cpu_kernels.cpu_linear_bf16 [--model DIR] [--rows 1,8,64,256] [--threads 2]
        [--repeats 7] [--layers N]

For each row count, one "pass" runs every matrix once; the two weight dtypes take turns
pass by pass, and the best pass of each is reported, with float32 time / bf16 time (> 1:
bf16 faster) and the weight bytes per pass. Default model: SmolLM2-135M's shapes (the
default model's config.json under $PDSERVE_CACHE if converted, else its numbers).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


from pdserve.kernels import cpu_native

# SmolLM2-135M: hidden 576, 9 heads / 3 kv heads of 64, intermediate 1536, 30 layers, vocab 49152
SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
           "intermediate_size": 1536, "num_hidden_layers": 30, "vocab_size": 49152}


def model_config(model: str | None) -> dict:
    if model is not None:
        return json.loads((Path(model) / "config.json").read_text())
    cache = Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))
    path = cache / "SmolLM2-135M-Instruct-Q4_1" / "config.json"
    return json.loads(path.read_text()) if path.is_file() else SMOLLM2


def shapes(cfg: dict, layers: int | None) -> list[tuple[int, int]]:
    """(n, k) of every linear of one forward pass."""
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    one = [((heads + 2 * kv_heads) * head_dim, hidden), (hidden, heads * head_dim), (2 * inter, hidden),
           (hidden, inter)]
    return one * (layers or cfg["num_hidden_layers"]) + [(cfg["vocab_size"], hidden)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,8,64,256")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=None, help="layers to take (default: the model's)")
    args = ap.parse_args(argv)
    if cpu_native.library() is None:
        sys.exit("the native kernels did not build (is a C compiler installed?)")
    torch.set_num_threads(args.threads)
    dims = shapes(model_config(args.model), args.layers)
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) / k ** 0.5 for n, k in dims]
    packed = {dt: [cpu_native.pack_weight(w, dt) for w in weights] for dt in (torch.float32, torch.bfloat16)}
    del weights
    names = {torch.float32: "float32", torch.bfloat16: "bf16"}
    print(f"{len(dims)} matrices, {sum(n * k for n, k in dims) / 1e6:.1f} M weights, {args.threads} threads")
    print(f"{'rows':>5} {'float32 ms':>11} {'bf16 ms':>9} {'f32/bf16':>9} {'f32 GB/s':>9} {'bf16 GB/s':>10}")
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in dims}}
        best = {dt: float("inf") for dt in packed}
        for _ in range(args.repeats):
            for dt, ps in packed.items():  # alternating, pass by pass
                t0 = time.perf_counter()
                for (n, k), p in zip(dims, ps):
                    cpu_native.gemm(xs[k], p, n)
                best[dt] = min(best[dt], time.perf_counter() - t0)
        f32, bf = best[torch.float32], best[torch.bfloat16]
        nbytes = {dt: sum(p.numel() * p.element_size() for p in ps) for dt, ps in packed.items()}
        print(f"{m:>5} {f32 * 1e3:>11.2f} {bf * 1e3:>9.2f} {f32 / bf:>9.2f} "
              f"{nbytes[torch.float32] / f32 / 1e9:>9.1f} {nbytes[torch.bfloat16] / bf / 1e9:>10.1f}")
        results.append({"rows": m, **{f"{names[dt]}_ms": best[dt] * 1e3 for dt in packed}, "ratio": f32 / bf})
    print(json.dumps(results))


if __name__ == "__main__":
    main()
