"""Single-stream decode against the weight-streaming bound, measured in the same run.

    python -m benchmarks.decode.single_stream [--model DIR_OR_GGUF] [--threads 2] [--tokens 64] [--rounds 5]
        [--dtype float32[,bfloat16,float32+int8,float32+int4,float32+gguf]] [--nominal-gb-s X --nominal-source S]
        [--out results/decode/single_stream.json]

One request at a time decodes every token by reading all of the model's weights once,
so a decode step cannot beat (weight bytes) / (memory read bandwidth). Both are measured
here, in this process, with the engine's thread count:

- bound: the bytes a decode step streams -- each linear's weight as the GEMM reads it (its
  int8 / int4 blocks, scales included, where quantized), the lm_head's included (the tied
  embedding table counted once, as the lm_head; an embedding table is otherwise only
  looked up), norms and biases, and the K and V the attention reads (every layer's, at
  the mean context of the timed steps, in the cache's dtype) -- over the best
  multi-threaded streaming read (benchmarks/harness/bandwidth.py: the engine's threads, a
  buffer of the same size, random values) of the run. The report says whether those bytes fit
  in the last-level cache (then the bound is that cache's, not DRAM's) and sets the figure
  against the chip's nominal bandwidth where it is known (`--nominal-gb-s`, with its source);
- decode: `LLM.generate` of `--tokens` greedy tokens (ignore_eos) from a 32-token prompt,
  `--rounds` times; per-token time = (last token - first token) / (tokens - 1) from the
  engine's own per-step timing, so the prompt's prefill is not counted. Best and median
  rounds are reported; the ratio uses the median.

With several dtypes (`--dtype float32,bfloat16`) one engine per dtype runs in this process,
taking turns round by round; each gets its own bound (its weights' bytes: bf16 halves
them) and the report adds float32's median over each other dtype's. A dtype may name a
weight quantization after "+" (`float32+int4`: `--quantization int4`; `float32+gguf`: a
GGUF model's own Q4_1 / Q8_0 linears); without one the engine runs `--quantization none`.

Default model: the embedded SmolLM2-135M-Instruct (float32 after conversion, 538 MB of
weights). Target: median per-token time <= 2x the bound.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from benchmarks.harness.bandwidth import bound_facts, stream_read_bandwidth
from benchmarks.harness.facts import run_facts
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.output import write_report
from pdserve.common import LLM, SamplingParams

TARGET_RATIO = 2.0
PROMPT = 32  # prompt tokens of each timed request


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step streams (see the module docstring)."""
    from pdserve.common.models.layers import Linear
    seen, total = set(), 0
    for module in model.modules():
        params = [p for p in module.parameters(recurse=False) if p.data_ptr() not in seen]
        if isinstance(module, torch.nn.Embedding):
            continue  # looked up; a tied lm_head counts the table as its weight
        seen.update(p.data_ptr() for p in params)
        quant = getattr(module, "quant", None) if isinstance(module, Linear) else None
        if quant is not None:
            total += quant.nbytes
            params = [p for p in params if p is not module.weight]
        total += sum(p.numel() * p.element_size() for p in params)
    return total


def kv_bytes(llm: LLM, tokens: int, prompt: int = PROMPT) -> int:
    """Bytes of K and V the attention reads per step, at the mean context of the timed
    steps (contexts prompt + 1 .. prompt + tokens - 1: the first token comes with the
    prefill)."""
    m, cache = llm.engine.config.model, llm.engine.runner.kv_cache
    per_token = 2 * m.num_layers * m.num_kv_heads * m.head_dim * cache.element_size()
    return per_token * (2 * prompt + tokens) // 2


def decode_ms(llm: LLM, tokens: int) -> float:
    """Per decode step of one request: (last token - first token) / (tokens - 1)."""
    engine = llm.engine
    seq = engine.new_sequence(list(range(10, 10 + PROMPT)), SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0))
    engine.add(seq)
    stamps = []
    while engine.has_work():
        engine.step()
        stamps.append((time.perf_counter(), len(seq.output_token_ids)))
    first = next(t for t, n in stamps if n >= 1)
    return (stamps[-1][0] - first) / (tokens - 1) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="model dir or .gguf (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="engine dtype, or several comma-separated, alternated")
    ap.add_argument("--nominal-gb-s", type=float, default=None, help="the chip's nominal memory bandwidth, if known")
    ap.add_argument("--nominal-source", default=None, help="where --nominal-gb-s comes from (a datasheet, ...)")
    ap.add_argument("--out", default=str(RESULTS / "decode" / "single_stream.json"))
    args = ap.parse_args()
    model = args.model
    if model is None:
        from pdserve.common.loading.default_model import resolve_model_dir
        model = resolve_model_dir(None)
    dtypes = args.dtype.split(",")
    llms = {dt: LLM(model, num_threads=args.threads, num_kv_blocks=64, max_model_len=512, dtype=dt.partition("+")[0],
                    quantization=dt.partition("+")[2] or "none") for dt in dtypes}
    for llm in llms.values():
        decode_ms(llm, 8)  # warm-up: kernels built, weights packed, caches warm
    kv = {dt: kv_bytes(llm, args.tokens) for dt, llm in llms.items()}
    nbytes = {dt: weight_bytes(llm.engine.runner.model) + kv[dt] for dt, llm in llms.items()}
    runs: dict[str, list[dict]] = {dt: [] for dt in dtypes}
    for _ in range(args.rounds):  # alternate bound and decode (and dtypes), so drift in the load hits all
        for dt, llm in llms.items():
            bw = stream_read_bandwidth(nbytes[dt], args.threads, 3)
            runs[dt].append({"read_gb_s": bw / 1e9, "bound_ms": nbytes[dt] / bw * 1000,
                             "decode_ms": decode_ms(llm, args.tokens)})
    by_dtype = {}
    for dt in dtypes:
        bound = min(r["bound_ms"] for r in runs[dt])  # the best bandwidth seen: the tightest bound
        med = statistics.median(r["decode_ms"] for r in runs[dt])
        facts = bound_facts(nbytes[dt], args.threads, nbytes[dt] / bound * 1000, args.nominal_gb_s, args.nominal_source)
        nominal_ms = nbytes[dt] / (args.nominal_gb_s * 1e9) * 1000 if args.nominal_gb_s else None
        by_dtype[dt] = {"weight_bytes": nbytes[dt] - kv[dt], "kv_bytes": kv[dt], "runs": runs[dt], "bound_ms": bound,
                        "bound": facts, "nominal_bound_ms": nominal_ms,
                        "decode_ms_best": min(r["decode_ms"] for r in runs[dt]), "decode_ms_median": med,
                        "ratio_to_bound": med / bound, "ratio_to_nominal_bound": med / nominal_ms if nominal_ms else None,
                        "met": med / bound <= TARGET_RATIO}
        print(f"{dt}: weights and KV {nbytes[dt] / 1e6:.0f} MB ({'fit in' if facts['fits_in_llc'] else 'exceed'} the "
              f"{(facts['llc_bytes'] or 0) / 2**20:.0f} MiB last-level cache: a bound of {facts['bound_of']}); streaming "
              f"read best {nbytes[dt] / bound / 1e6:.1f} GB/s on {args.threads} thread(s) -> bound {bound:.1f} ms/token"
              + (f"; nominal {args.nominal_gb_s} GB/s -> {nominal_ms:.1f} ms/token" if nominal_ms else
                 "; nominal bandwidth not known for this chip"))
        each = " ".join(f"{r['decode_ms']:.1f}" for r in runs[dt])
        print(f"{dt}: decode median {med:.1f} ms/token, best {by_dtype[dt]['decode_ms_best']:.1f} ({each}); "
              f"{med / bound:.2f}x the measured bound (target <= {TARGET_RATIO}x: {'met' if by_dtype[dt]['met'] else 'MISSED'})"
              + (f", {med / nominal_ms:.2f}x the nominal one" if nominal_ms else ""))
    first = by_dtype[dtypes[0]]
    for dt in dtypes[1:]:
        print(f"{dtypes[0]} median / {dt} median: {first['decode_ms_median'] / by_dtype[dt]['decode_ms_median']:.2f}")
    report = {
        **run_facts(threads=args.threads), "model": str(model), "threads": args.threads, "tokens": args.tokens,
        "target_ratio": TARGET_RATIO, **first, "by_dtype": by_dtype,  # the first dtype's figures at the top level
    }
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
