"""The CPU engine's linear layers: the native packed GEMM (kernels/csrc/gemm_cpu.c) against
MKL (`F.linear`, what transformers runs) and oneDNN on its own packed weight, side by side
in one process, alternating, on one decoder layer's four matrices of a model.

    python -m benchmarks.cpu_kernels.cpu_linear [--model DIR] [--rows 1,4,8,16,32,64,256,2048]
        [--threads 2] [--repeats 20] [--out results/cpu_linear.json]

For every row count (a decode batch or a prefill chunk) the four products of one layer
(q/k/v, o, gate/up, down) run once per engine per repeat, the engines taking turns; the
best repeat of each gives GFLOP/s. Also reported: whether the native result equals MKL's
bit for bit (it follows MKL's summation order where MKL runs its blocked kernel: 4 rows
or more in multiples of 4, or 16 or more) and its largest difference otherwise.
Default model: the small qwen3 (made under results/models/qwen3-small if missing).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.harness.models import ensure_model
from benchmarks.harness.paths import REPO

from pdserve.kernels import cpu_native


def layer_shapes(model_dir: Path) -> list[tuple[str, int, int]]:
    """(name, n, k) of one decoder layer's four matrices."""
    cfg = json.loads((model_dir / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", heads)
    head_dim = cfg.get("head_dim") or hidden // heads
    return [("qkv", (heads + 2 * kv_heads) * head_dim, hidden), ("o", hidden, heads * head_dim),
            ("gate_up", 2 * inter, hidden), ("down", hidden, inter)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HuggingFace-format model dir (default: the small qwen3)")
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--out", default=str(REPO / "results" / "cpu_linear.json"))
    args = ap.parse_args(argv)
    if cpu_native.library() is None:
        sys.exit("the native kernels did not build (is a C compiler installed?)")
    torch.set_num_threads(args.threads)
    model_dir = ensure_model(args.model)
    shapes = layer_shapes(model_dir)
    gen = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=gen) / k ** 0.5 for _, n, k in shapes]
    packed = [cpu_native.pack_weight(w) for w in weights]
    onednn = [torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in weights]
    rows_list = [int(r) for r in args.rows.split(",")]
    results = []
    print(f"{model_dir.name}: one layer's {', '.join(f'{s} [{n}, {k}]' for s, n, k in shapes)}; "
          f"{args.threads} threads; GFLOP/s, best of {args.repeats}")
    print(f"{'rows':>6}{'native':>9}{'MKL':>9}{'oneDNN':>9}{'vs MKL':>9}{'vs oneDNN':>11}  equal to MKL")
    for m in rows_list:
        xs = [torch.randn(m, k, generator=gen) for _, _, k in shapes]
        engines = {
            "native": lambda xs=xs: [cpu_native.gemm(x, p, w.shape[0]) for x, p, w in zip(xs, packed, weights)],
            "mkl": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights)],
            "onednn": lambda xs=xs: [torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                                     for x, p in zip(xs, onednn)],
        }
        diffs = [(a - b).abs().max().item() for a, b in zip(engines["native"](), engines["mkl"]())]
        best = {name: float("inf") for name in engines}
        for rep in range(args.repeats):
            for name in (list(engines) if rep % 2 == 0 else list(engines)[::-1]):
                t = time.perf_counter()
                engines[name]()
                best[name] = min(best[name], time.perf_counter() - t)
        flops = sum(2 * m * n * k for _, n, k in shapes)
        gf = {name: flops / t / 1e9 for name, t in best.items()}
        equal = max(diffs) == 0
        results.append({"rows": m, "gflops": gf, "equal_to_mkl": equal, "max_abs_diff_vs_mkl": max(diffs)})
        print(f"{m:>6}{gf['native']:>9.1f}{gf['mkl']:>9.1f}{gf['onednn']:>9.1f}{gf['native'] / gf['mkl']:>8.2f}x"
              f"{gf['native'] / gf['onednn']:>10.2f}x  {'yes' if equal else f'no ({max(diffs):.1e})'}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": str(model_dir), "shapes": shapes, "threads": args.threads,
                               "repeats": args.repeats, "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
