"""A/B of the native CPU kernels: another checkout's library (say /work/main) against this
tree's, in one process, alternating pass by pass, on the same inputs; bits compared.

    python -m benchmarks.cpu_kernels.native_ab --baseline /work/main [--what gemm,attention] [--rows 4,8,16]
        [--dtype bfloat16,float32,q8_0,q4_1] [--threads 1] [--passes 15]

Both libraries are built by their own `kernels/cpu_native.py` (each source set hashes to
its own cached build). gemm: every linear of the small qwen3's 12 layers (qkv, o,
gate_up, down: hidden 512, intermediate 1536), `--rows` rows of x, weights packed in the
dtype (q8_0 / q4_1: weight-only int8 / int4 blocks, `kernels.quant`, by the int8 dot
products of pd_gemm_qdot). attention (float32 and bf16 caches): paged decode attention over the 12 layers' caches (8 query / 4 KV heads
of 64, blocks of 16 in a random order), 4 and 16 sequences of up to 100 and 400 tokens.
Per case: the median pass of each and the median of the per-pass ratios baseline / this
(> 1: this tree is faster), and whether the two outputs are equal bit for bit.
"""
from __future__ import annotations

import argparse
import functools
import re
import statistics
import sys
import time
import types
from pathlib import Path

import torch


from pdserve.kernels import cpu_native, quant

HIDDEN, INTER, LAYERS, HQ, HKV, D, BS = 512, 1536, 12, 8, 4, 64, 16
SHAPES = [(HQ * D + 2 * HKV * D, HIDDEN), (HIDDEN, HQ * D), (2 * INTER, HIDDEN), (HIDDEN, INTER)]
QUANT_KINDS = ("q8_0", "q4_1")  # weight-only int8 / int4 (kernels.quant), multiplied by int8 dot products


def baseline_module(checkout: str) -> types.ModuleType:
    """`checkout`'s kernels/cpu_native.py as a module of its own (its sources, its build)."""
    path = Path(checkout) / "pdserve" / "kernels" / "cpu_native.py"
    if not path.exists():  # a checkout from before the one `pdserve` package
        path = Path(checkout) / "kernels" / "cpu_native.py"
    mod = types.ModuleType("baseline_cpu_native")
    mod.__file__ = str(path)
    # its relative imports (`from . import huge_pages`, `from .atomic_file import replaced`) from this tree's package
    source = re.sub(r"^from \.(\w*) import", lambda m: f"from pdserve.kernels{'.' + m[1] if m[1] else ''} import",
                    path.read_text(), flags=re.M)
    exec(compile(source, str(path), "exec"), mod.__dict__)
    return mod


def alternate(fns: dict[str, object], passes: int) -> dict[str, list[float]]:
    """Seconds of each fn per pass, the order flipped every pass."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(passes):
        for name in (list(fns) if i % 2 == 0 else list(fns)[::-1]):
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def report(case: str, times: dict[str, list[float]], same: bool) -> dict:
    base, new = times["baseline"], times["this"]
    ratio = statistics.median(b / n for b, n in zip(base, new))
    print(f"{case:34} baseline {statistics.median(base) * 1e3:7.2f} ms  this {statistics.median(new) * 1e3:7.2f} ms  "
          f"baseline/this {ratio:.3f}  bits equal: {same}", flush=True)
    return {"case": case, "baseline_s": base, "this_s": new, "ratio": ratio, "bits_equal": same}


def run_gemms(fn, packed: list[list[torch.Tensor]], xs: dict, ys: dict) -> None:
    """y = x @ w^T for every packed matrix of every layer, through one library's `fn`."""
    for layer in packed:
        for (n, k), p in zip(SHAPES, layer):
            x = xs[k]
            fn(x.data_ptr(), k, x.shape[0], k, p.data_ptr(), None, ys[n].data_ptr(), n, n, torch.get_num_threads())


def run_attention(fn, caches: list, q: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                  out: torch.Tensor) -> None:
    """Paged decode attention over every layer's caches, through one library's `fn`."""
    for k, v in caches:
        if fn(q.data_ptr(), k.data_ptr(), v.data_ptr(), tables.data_ptr(), lens.data_ptr(), out.data_ptr(),
              q.shape[0], HQ, HKV, D, BS, tables.shape[1], k.shape[0], *k.stride()[:3], *v.stride()[:3],
              D ** -0.5, torch.get_num_threads()):
            raise RuntimeError("the attention kernel refused the call")


def run_gemms_q(fn, packed: list[list[quant.QuantWeight]], xs: dict, ys: dict) -> None:
    """`run_gemms` for quantized matrices, by a library's int8 dot products (pd_gemm_qdot)."""
    for layer in packed:
        for (n, k), w in zip(SHAPES, layer):
            x = xs[k]
            fn(x.data_ptr(), k, x.shape[0], k, w.data.data_ptr(), w.code, None, ys[n].data_ptr(), n, n,
               torch.get_num_threads())


def gemm_cases(libs: dict, rows: list[int], dtype: str, passes: int) -> list[dict]:
    """dtype: float32 or bfloat16 (packed panels, pd_gemm / pd_gemm_bf16), or q8_0 / q4_1
    (kernels.quant blocks, pd_gemm_qdot)."""
    g = torch.Generator().manual_seed(0)
    quantized = dtype in QUANT_KINDS
    make = ((lambda w: quant.quantize(w, dtype)) if quantized
            else (lambda w: cpu_native.pack_weight(w, getattr(torch, dtype))))
    packed = [[make(torch.randn(n, k, generator=g) / k ** 0.5) for n, k in SHAPES] for _ in range(LAYERS)]
    out = []
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in SHAPES}
        ys = {name: {n: torch.empty(m, n) for n, _ in SHAPES} for name in libs}
        fns = {}
        for name, lib in libs.items():
            if quantized:
                fn = lib.pd_gemm_qdot
                fn.restype, fn.argtypes = lib.pd_gemm_q.restype, lib.pd_gemm_q.argtypes
                fns[name] = functools.partial(run_gemms_q, fn, packed, xs, ys[name])
            else:
                fn = lib.pd_gemm_bf16 if dtype == "bfloat16" else lib.pd_gemm
                fns[name] = functools.partial(run_gemms, fn, packed, xs, ys[name])
        times = alternate(fns, passes)
        same = all(torch.equal(ys["baseline"][n], ys["this"][n]) for n, _ in SHAPES)
        out.append(report(f"gemm {dtype} {m} rows", times, same))
    return out


def attention_cases(libs: dict, dtype: torch.dtype, passes: int) -> list[dict]:
    out = []
    for batch, ctx in ((4, 400), (16, 400), (16, 100)):
        g = torch.Generator().manual_seed(batch + ctx)
        per_seq = ctx // BS + 1
        caches = [tuple(torch.randn(batch * per_seq, HKV, BS, D, generator=g).to(dtype).transpose(1, 2)
                        for _ in range(2)) for _ in range(LAYERS)]
        tables = torch.randperm(batch * per_seq, generator=g).to(torch.int32).reshape(batch, per_seq).contiguous()
        lens = torch.randint(ctx // 2, ctx + 1, (batch,), generator=g).to(torch.int32)
        q = torch.randn(batch, HQ, D, generator=g)
        outs = {name: torch.empty_like(q) for name in libs}
        fns = {name: functools.partial(run_attention, lib.pd_paged_decode_attention_bf16 if dtype == torch.bfloat16
                                       else lib.pd_paged_decode_attention, caches, q, tables, lens, outs[name])
               for name, lib in libs.items()}
        times = alternate(fns, passes)
        out.append(report(f"attention {str(dtype)[6:]} {batch} x <= {ctx}", times,
                          torch.equal(outs["baseline"], outs["this"])))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="another checkout of pdserve (its kernels/ are built and loaded)")
    ap.add_argument("--what", default="gemm,attention")
    ap.add_argument("--rows", default="4,8,16")
    ap.add_argument("--dtype", default="bfloat16,float32", help="float32, bfloat16, q8_0, q4_1 (comma-separated)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--passes", type=int, default=15)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    libs = {"baseline": baseline_module(args.baseline).library(), "this": cpu_native.library()}
    if None in libs.values():
        sys.exit("a native library did not build (see the warning above)")
    for dtype in args.dtype.split(","):
        if dtype not in ("float32", "bfloat16", *QUANT_KINDS):
            ap.error(f"--dtype {dtype!r}: one of float32, bfloat16, {', '.join(QUANT_KINDS)}")
        if "gemm" in args.what:
            gemm_cases(libs, [int(r) for r in args.rows.split(",")], dtype, args.passes)
        if "attention" in args.what and dtype not in QUANT_KINDS:  # the caches are float32 or bf16
            attention_cases(libs, getattr(torch, dtype), args.passes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
