"""Weight-only int8 / int4 against float32 and bf16 packed weights in the native CPU GEMM
(kernels/csrc/gemm_cpu.c, gemm_quant_cpu.c): every linear of a model's forward pass as
distinct matrices (weights streamed from memory as in a decode step), float32 activations
in all, the four forms taking turns pass by pass in one process, each against its own
weight-streaming bound measured in the same run.

    python -m benchmarks.cpu_kernels.cpu_linear_quant [--model DIR] [--rows 1,8,64] [--threads 2]
        [--repeats 7] [--layers N] [--out results/cpu_linear_quant.json]

Forms as the engine holds them: float32 and bf16 panels; int8 = every matrix Q8_0; int4 =
the layers' matrices Q4_1 and the lm_head Q8_0 (`--quantization int8|int4`; the quantized
matrices in one buffer in forward order, `quant.in_one_buffer`), multiplied by
int8 dot products at every row count (`gemm_q(..., dequant=False)`; the engine's choice up
to `quant.QDOT_ROWS`); int8-tile / int4-tile = the same matrices on the tile that
dequantizes in registers (`dequant=True`; the engine's choice past that), old and new
kernels side by side. For each row
count the best pass of each form is reported with its bytes and its ratio to the bound
(bytes / the best of `--repeats` `torch.sum` passes over a random float32 buffer as big as
the float32 weights, timed between the passes). Default model: SmolLM2-135M's shapes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.harness.paths import REPO

from benchmarks.cpu_kernels.cpu_linear_bf16 import model_config, shapes
from pdserve.kernels import cpu_native, quant


def forms(weights: list[torch.Tensor]) -> dict[str, list]:
    """Each form's matrices: packed tensors (float32, bf16) or QuantWeights."""
    last = len(weights) - 1  # the lm_head
    return {"float32": [cpu_native.pack_weight(w) for w in weights],
            "bf16": [cpu_native.pack_weight(w, torch.bfloat16) for w in weights],
            "int8": quant.in_one_buffer([quant.quantize(w, "q8_0") for w in weights]),
            "int4": quant.in_one_buffer([quant.quantize(w, "q8_0" if i == last else "q4_1")
                                         for i, w in enumerate(weights)])}


TILE = "-tile"  # a form's name ending so: its quantized matrices on the dequantizing tile


def with_tile_forms(mats: dict[str, list]) -> dict[str, list]:
    return {**mats, **{name + TILE: mats[name] for name in ("int8", "int4")}}


def nbytes(mats: list) -> int:
    return sum(m.nbytes if isinstance(m, quant.QuantWeight) else m.numel() * m.element_size() for m in mats)


def run_pass(mats: list, dims: list[tuple[int, int]], xs: dict[int, torch.Tensor], dequant: bool = False) -> float:
    t0 = time.perf_counter()
    for (n, k), m in zip(dims, mats):
        if isinstance(m, quant.QuantWeight):
            quant.gemm_q(xs[k], m, dequant=dequant)
        else:
            cpu_native.gemm(xs[k], m, n)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,8,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--layers", type=int, default=None, help="layers to take (default: the model's)")
    ap.add_argument("--out", default=str(REPO / "results" / "cpu_linear_quant.json"))
    args = ap.parse_args(argv)
    if cpu_native.library() is None:
        sys.exit("the native kernels did not build (is a C compiler installed?)")
    torch.set_num_threads(args.threads)
    dims = shapes(model_config(args.model), args.layers)
    g = torch.Generator().manual_seed(0)
    mats = with_tile_forms(forms([torch.randn(n, k, generator=g) / k ** 0.5 for n, k in dims]))
    size = {name: nbytes(ms) for name, ms in mats.items()}
    buf = torch.rand(size["float32"] // 4)
    print(f"{len(dims)} matrices, {sum(n * k for n, k in dims) / 1e6:.1f} M weights, {args.threads} threads; "
          + ", ".join(f"{name} {b / 1e6:.0f} MB" for name, b in size.items()))
    results = []
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g) for k in {k for _, k in dims}}
        best = {name: float("inf") for name in mats}
        read = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            buf.sum()
            read = min(read, time.perf_counter() - t0)
            for name, ms in mats.items():  # alternating, pass by pass
                best[name] = min(best[name], run_pass(ms, dims, xs, name.endswith(TILE)))
        bw = buf.numel() * 4 / read
        row = {"rows": m, "read_gb_s": bw / 1e9}
        for name in mats:
            bound = size[name] / bw
            row[name] = {"ms": best[name] * 1e3, "bytes": size[name], "bound_ms": bound * 1e3,
                         "ratio_to_bound": best[name] / bound, "float32_over_this": best["float32"] / best[name]}
        print(f"rows {m}: read {bw / 1e9:.1f} GB/s; " + "; ".join(
            f"{name} {r['ms']:.2f} ms ({r['ratio_to_bound']:.2f}x bound, {r['float32_over_this']:.2f}x float32)"
            for name, r in ((n, row[n]) for n in mats)))
        results.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join([Path(sys.executable).name, *sys.argv]), "threads": args.threads,
                               "results": results}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
