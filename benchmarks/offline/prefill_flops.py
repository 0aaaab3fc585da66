"""Prefill's achieved FLOP/s against the chip's GEMM peak for the same dtype, both measured
in one run (issue 28).

    python -m benchmarks.offline.prefill_flops [--model DIR_OR_GGUF] [--threads 2] [--tokens 512,2048] [--rounds 3]
        [--dtype float32,bfloat16[,float32+int8,float32+int4]] [--gemm-size 4096] [--torch-budget-s 5]
        [--out results/prefill_flops.json]

Prefill is the compute-bound phase: one prompt of T tokens multiplies every linear's
weight by T rows. For each dtype and each prompt length T:

- prefill: one request of T random token ids, `max_tokens=1`, prefix caching off and a
  token budget of T (one step: every row in one chunk), timed from `engine.add` to the
  step that returns its first token; the median of `--rounds` rounds, dtypes and lengths
  taking turns so that drift in the load hits all;
- FLOPs of that prefill: 2 x (weights of the decoder's linears) x T, plus the lm_head's
  2 x hidden x vocab for the one row sampled, plus attention's 4 x layers x heads x
  head_dim x T (T + 1) / 2 (QK^T and PV over the causal pairs). Norms, RoPE, softmax and
  the activation are left out, as usual;
- peak: the best of `--rounds` products of two `--gemm-size` square matrices (one a
  round, after that round's prefills), by `torch.matmul` in that dtype (float32 for a
  weight-quantized dtype) and by pdserve's own GEMM (`kernels.cpu_native`: float32
  activations on the weight packed in that dtype, or `kernels.quant`: quantized and
  dequantized in registers). The faster of the two is the peak the prefill is held against; both are
  reported. torch's bf16 GEMM is a scalar loop on a CPU without AVX512_BF16 / AMX (under
  5 GFLOP/s): its size is halved until one product fits in `--torch-budget-s` (timed at
  512 first), and the size used is reported.

Each round also records the share of the machine's CPU that other processes took
(`benchmarks/harness/timing.py`: 0 on a quiet machine).

A dtype may name a weight quantization after "+" (`float32+int4`), as in
benchmarks/decode/single_stream.py. Default model: the embedded SmolLM2-135M-Instruct.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.harness.paths import REPO

from benchmarks.harness.timing import Phase
from benchmarks.harness.facts import run_facts
from benchmarks.harness.output import write_report
from pdserve.common import LLM, SamplingParams
from pdserve.kernels import cpu_native

TORCH_PROBE = 512  # size of the first torch GEMM, which sizes the timed one


def linear_weights(model: torch.nn.Module) -> int:
    """Weights of the decoder layers' linears (the lm_head apart: it runs on one row)."""
    from pdserve.common.models.layers import Linear
    return sum(m.in_features * m.out_features for name, m in model.named_modules()
               if isinstance(m, Linear) and name != "lm_head")


def prefill_flops(model: torch.nn.Module, tokens: int) -> float:
    """FLOPs of one prefill of `tokens` tokens (see the module docstring)."""
    cfg = model.config
    attention = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * tokens * (tokens + 1) / 2
    return 2 * linear_weights(model) * tokens + 2 * cfg.hidden_size * cfg.vocab_size + attention


def prefill_s(llm: LLM, tokens: int, seed: int) -> float:
    """Seconds from adding a request of `tokens` random ids to its first token."""
    engine = llm.engine
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, engine.config.model.vocab_size, (tokens,), generator=g).tolist()
    t0 = time.perf_counter()
    seq = engine.new_sequence(ids, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    engine.add(seq)
    while engine.has_work():
        engine.step()
    seconds = time.perf_counter() - t0
    if len(seq.output_token_ids) != 1:
        raise RuntimeError(f"the prefill of {tokens} tokens produced {len(seq.output_token_ids)} tokens")
    return seconds


def timed_best(fn, rounds: int) -> float:
    """Best seconds of `rounds` calls of fn (after one untimed)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def torch_size(dtype: torch.dtype, size: int, budget_s: float) -> int:
    """The largest of size, size / 2, ... whose torch product is estimated (from one at
    TORCH_PROBE, cubic in the size) to fit in budget_s."""
    a = torch.randn(TORCH_PROBE, TORCH_PROBE).to(dtype)
    probe = timed_best(lambda: torch.matmul(a, a), 1)
    while size > TORCH_PROBE and probe * (size / TORCH_PROBE) ** 3 > budget_s:
        size //= 2
    return size


class GemmPeak:
    """The two square GEMMs of one dtype, operands made once: torch.matmul at torch_n in
    that dtype (float32 for a weight-quantized one), pdserve's at `size` on the weight
    packed (or quantized) as the engine holds it. `time_once` runs each once; the best of
    the rounds is the peak."""

    def __init__(self, dtype: str, size: int, torch_n: int) -> None:
        act, _, quant = dtype.partition("+")
        tdt = getattr(torch, act)
        g = torch.Generator().manual_seed(0)
        self.size, self.torch_n = size, torch_n
        self.a, self.b = (torch.randn(torch_n, torch_n, generator=g).to(tdt) for _ in range(2))
        x, w = torch.randn(size, size, generator=g), torch.randn(size, size, generator=g) / size ** 0.5
        if quant:
            from pdserve.kernels.quant import FROM_FLOAT, gemm_q, quantize
            qw = quantize(w, FROM_FLOAT[quant])
            self.native = lambda: gemm_q(x, qw, dequant=True)
        else:
            packed = cpu_native.pack_weight(w, tdt)
            self.native = lambda: cpu_native.gemm(x, packed, size)
        self.torch_s, self.native_s = [], []
        self.time_once()  # untimed: first-use costs
        self.torch_s.clear()
        self.native_s.clear()

    def time_once(self) -> None:
        t0 = time.perf_counter()
        torch.matmul(self.a, self.b)
        t1 = time.perf_counter()
        self.native()
        self.torch_s.append(t1 - t0)
        self.native_s.append(time.perf_counter() - t1)

    def report(self) -> dict:
        torch_gf = 2 * self.torch_n ** 3 / min(self.torch_s) / 1e9
        native_gf = 2 * self.size ** 3 / min(self.native_s) / 1e9
        return {"torch_size": self.torch_n, "torch_s": self.torch_s, "torch_gflops": torch_gf,
                "pdserve_size": self.size, "pdserve_s": self.native_s, "pdserve_gflops": native_gf,
                "peak_gflops": max(torch_gf, native_gf), "peak_by": "torch" if torch_gf >= native_gf else "pdserve"}


def make_llm(model: str, dtype: str, threads: int, longest: int) -> LLM:
    act, _, quant = dtype.partition("+")
    return LLM(model, num_threads=threads, dtype=act, quantization=quant or "none", enable_prefix_caching=False,
               max_num_batched_tokens=longest, max_model_len=longest + 16, num_kv_blocks=(longest + 16) // 16 + 2)


def summary(dtype: str, runs: dict[int, list[float]], flops: dict[int, float], peak: dict) -> dict:
    rows = {}
    for t, secs in runs.items():
        med = statistics.median(secs)
        gf = flops[t] / med / 1e9
        rows[t] = {"seconds": secs, "median_s": med, "gflop": flops[t] / 1e9, "gflops": gf,
                   "share_of_peak": gf / peak["peak_gflops"]}
        print(f"{dtype:>14} {t:>7} {med * 1e3:>10.1f} {flops[t] / 1e9:>8.1f} {gf:>8.1f} {peak['torch_gflops']:>11.1f}"
              f" {peak['pdserve_gflops']:>13.1f} {gf / peak['peak_gflops']:>7.0%}")
    return {"gemm": peak, "prefill": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", default="512,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="float32,bfloat16", help="engine dtypes, comma-separated, alternated")
    ap.add_argument("--gemm-size", type=int, default=4096, help="side of the square GEMMs that measure the peak")
    ap.add_argument("--torch-budget-s", type=float, default=5.0, help="longest one torch GEMM may take (see above)")
    ap.add_argument("--out", default=str(REPO / "results" / "prefill_flops.json"))
    args = ap.parse_args(argv)
    if cpu_native.library() is None:
        sys.exit("the native kernels did not build (is a C compiler installed?)")
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = resolve_model_dir(None)
    torch.set_num_threads(args.threads)
    dtypes, lengths = args.dtype.split(","), [int(t) for t in args.tokens.split(",")]
    llms = {dt: make_llm(str(model), dt, args.threads, max(lengths)) for dt in dtypes}
    flops = {dt: {t: prefill_flops(llm.engine.runner.model, t) for t in lengths} for dt, llm in llms.items()}
    for llm in llms.values():
        prefill_s(llm, min(lengths), seed=0)  # warm-up: kernels built, weights packed
    gemms = {dt: GemmPeak(dt, args.gemm_size, torch_size(getattr(torch, dt.partition("+")[0]), args.gemm_size,
                                                           args.torch_budget_s)) for dt in dtypes}
    runs = {dt: {t: [] for t in lengths} for dt in dtypes}
    other = []  # the machine's CPU share other processes took, per round
    for r in range(args.rounds):  # prefills and GEMMs of every dtype take turns, so drift in the load hits all
        with Phase() as phase:
            for dt, llm in llms.items():
                for t in lengths:
                    runs[dt][t].append(prefill_s(llm, t, seed=r + 1))
                gemms[dt].time_once()
        other.append(phase.other_cpu_share)
    peaks = {dt: g.report() for dt, g in gemms.items()}
    print(f"{'dtype':>14} {'tokens':>7} {'prefill ms':>10} {'GFLOP':>8} {'GFLOP/s':>8} {'torch GF/s':>11} "
          f"{'pdserve GF/s':>13} {'of peak':>7}")
    by_dtype = {dt: summary(dt, runs[dt], flops[dt], peaks[dt]) for dt in dtypes}
    print("other processes' share of the machine's CPU, per round: "
          + " ".join("?" if o is None else f"{o:.0%}" for o in other))
    report = {**run_facts(), "model": str(model), "threads": args.threads, "rounds": args.rounds,
              "gemm_size": args.gemm_size, "other_cpu_share": other, "by_dtype": by_dtype}
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
