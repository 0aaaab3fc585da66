"""Every system on one trace, interleaved, in one process tree: vLLM's CPU build at its best
dtype for the chip and at pdserve's dtype, pdserve colocated, 1 prefill + 1 decode, and the
SLO planner (`serve --planner slo`), judged in SLO regimes derived from the systems' own
unloaded latency.

    python -m benchmarks.compare --vllm-python /work/vllm-venv/bin/python
        [--model DIR] [--pdserve-dtype float32] [--rates 1,2,4] [--num-prompts 100]
        [--input-len 256] [--output-len 64] [--regimes ttft_bound=3:10,tpot_bound=10:2]
        [--systems vllm,colocated,1p1d,planner] [--repeats 1] [--max-minutes 90]
        [--planner-config FILE] [--out results/compare/compare.json]

Method, in order:
1. Facts: the chip and its SIMD flags; vLLM's best dtype for it (bfloat16 where the CPU has
   AVX512_BF16 or AMX, float32 otherwise: on AVX2 vLLM's bf16 is an emulated slow path);
   the dtypes run = vLLM's best and `--pdserve-dtype` (one set when they are the same). At
   each dtype: vLLM, and pdserve at the same weights and precision (`--quantization none`:
   a GGUF model's kept-quantized linears would not be the weights vLLM runs).
2. Budgets, equal on both sides: --max-num-batched-tokens 2048 (vLLM's batched-token budget,
   pdserve's prefill chunk), --max-num-seqs 64, --max-model-len 1024; vLLM on both cores
   (VLLM_CPU_OMP_THREADS_BIND=0-1), pdserve colocated on 2 threads, 1P+1D on 1 each, the
   planner on the host's 2 cores from colocated (benchmarks/harness/servers.py).
3. Unloaded latency: every fixed system's server is started (each warmed up with two
   requests), and `--unloaded-requests` requests are sent to each one at a time; its
   median TTFT and TPOT (bootstrap 95% intervals) are its unloaded latency.
4. Regimes (benchmarks/compare/regimes.py): each bound a declared multiple of the slower
   system's unloaded TTFT / TPOT; default a TTFT-bound regime (3x / 10x) and a TPOT-bound one
   (10x / 2x). Then one planner server per regime and dtype is started with that regime's SLOs
   (its planner settings: pdserve's shipped defaults, or `--planner-config`).
5. The sweep, every server up: rate by rate, lowest first, every system in turn, the order
   reversed at every other rate; `--repeats` passes. A point: `--num-prompts` fresh random
   prompts (exactly --input-len in, --output-len out, ignore_eos, greedy), Poisson send times,
   the same prompts and times for every system at that rate and pass; one client for all
   (router/bench, HTTP). A planner's point is preceded by warm-up streams at its rate until one
   passes without a planner change (at most 2), its pools then left to settle; they are not
   counted. A fixed system or vLLM does not depend on the SLO: its point is judged under every
   regime; a planner's under its own.
6. Judging (benchmarks/compare/judge.py): per point and regime, attainment with its Wilson 95%
   interval; per system and regime, the goodput knee (router/stats/knee.py), censored where the
   sweep does not bracket it.
The JSON (rewritten after every point) holds the facts, every system's unloaded latency, the
regimes, every point with its latency figures (bootstrap intervals) and attainment per regime,
the knees, and the machine's load before and after each point. `--max-minutes` bounds the
run: a point that would start later is recorded as skipped. README's comparison table is
made from that JSON by `python -m benchmarks.compare.table`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks.compare.regimes import parse_rules
from benchmarks.compare.sweep import finish, sweep
from benchmarks.compare.systems import bring_up, fixed_systems, planner_systems, random_load
from benchmarks.harness.facts import best_bf16_dtype, machine_load, run_facts
from benchmarks.harness.models import ensure_model
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import RESULTS
from benchmarks.harness.servers import MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, PDSERVE_CONFIGS, VLLM_ENV, Server, log, vllm_version
from pdserve.common.config import ModelConfig
from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.router.stats.intervals import MIN_REQUESTS_PER_POINT


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu; without it vLLM is left out")
    p.add_argument("--model", default=None, help="default: the small qwen3, made once under results/models")
    p.add_argument("--pdserve-dtype", default="float32", choices=("float32", "bfloat16"),
                   help="pdserve's dtype; vLLM runs at it and at its own best dtype for the chip")
    p.add_argument("--rates", default="1,2,4")
    p.add_argument("--num-prompts", type=int, default=MIN_REQUESTS_PER_POINT,
                   help=f"requests per point and pass (default {MIN_REQUESTS_PER_POINT}: one request moves attainment "
                        f"by 1 point)")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--unloaded-requests", type=int, default=10)
    p.add_argument("--regimes", default="ttft_bound=3:10,tpot_bound=10:2",
                   help="NAME=TTFT_MULTIPLE:TPOT_MULTIPLE of the slower system's unloaded latency, comma-separated")
    p.add_argument("--systems", default="vllm,colocated,1p1d,planner")
    p.add_argument("--repeats", type=int, default=1, help="passes over every rate and system, interleaved")
    p.add_argument("--planner-config", default=None,
                   help="a JSON file whose `flags` are the planner's settings (e.g. the frozen file of "
                        "benchmarks/slo/planner_heldout.py); default: pdserve's shipped defaults")
    p.add_argument("--planner-warmup-s", type=float, default=20.0)
    p.add_argument("--max-minutes", type=float, default=90.0, help="no point starts after this")
    p.add_argument("--out", default=str(RESULTS / "compare" / "compare.json"))
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.repeats < 1 or args.unloaded_requests < 2:
        p.error("--num-prompts and --repeats must be >= 1, --unloaded-requests >= 2")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    freeze_startup_heap()  # this process is the load generator: no 100 ms collections mid-run
    t0 = time.monotonic()
    out_path = Path(args.out)
    logdir = RESULTS / "logs" / out_path.stem  # server logs: scratch, never beside a committed result
    logdir.mkdir(parents=True, exist_ok=True)
    layouts = [s for s in args.systems.split(",") if s]
    vver = vllm_version(args.vllm_python) if "vllm" in layouts else None
    if "vllm" in layouts and vver is None:
        log(f"SKIPPING vLLM: {args.vllm_python or 'no --vllm-python'} cannot import vllm")
        layouts.remove("vllm")
    args.model = str(ensure_model(args.model))
    args.planner_flags = json.loads(Path(args.planner_config).read_text())["flags"] if args.planner_config else {}
    vocab = ModelConfig.from_dir(args.model).vocab_size
    best = best_bf16_dtype()
    dtypes = list(dict.fromkeys([best, args.pdserve_dtype]))
    rules = parse_rules(args.regimes)
    rates = [float(r) for r in args.rates.split(",")]
    report: dict = {
        **run_facts(), "what": "every system on one trace, interleaved, in one process tree (benchmarks/compare)",
        "vllm_version": vver, "vllm_env": VLLM_ENV | {"LD_PRELOAD": "libiomp5.so"}, "model": args.model,
        "dtypes": {"vllm_best_for_chip": best, "pdserve": args.pdserve_dtype, "run": dtypes,
                   "why": ("the CPU has AVX512_BF16 or AMX: vLLM's bf16 is its fast path" if best == "bfloat16" else
                           "the CPU has neither AVX512_BF16 nor AMX: vLLM's bf16 is an emulated slow path and "
                           "float32 is its best"),
                   "quantization": "none on both sides (pdserve --quantization none)"},
        "budgets": {"max_num_batched_tokens": MAX_BATCHED, "max_num_seqs": MAX_NUM_SEQS, "max_model_len": MAX_MODEL_LEN,
                    "note": "the same on both sides: vLLM's batched-token budget, pdserve's prefill chunk",
                    "threads": {"vllm": "VLLM_CPU_OMP_THREADS_BIND=0-1", **{k: v[-1] for k, v in PDSERVE_CONFIGS.items()},
                                "planner": "the host's cores, from colocated"}},
        "workload": {"input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
                     "rates": rates, "repeats": args.repeats, "arrivals": "Poisson",
                     "prompts": "fresh random token ids per rate and pass, the same for every system"},
        "planner_settings": args.planner_flags or "pdserve's shipped defaults",
        "machine_load_before": machine_load(), "shared_machine_note": None,
    }
    fixed = fixed_systems(layouts, dtypes)
    load = random_load(args.input_len, args.output_len, vocab)
    servers: dict[str, Server] = {}
    try:
        systems, regimes = bring_up(fixed, lambda names: planner_systems(layouts, dtypes, names), args, vocab, logdir,
                                    rules, report, servers)
        sweep(systems, servers, rates, [load] * args.repeats, args, regimes, report, out_path, t0)
    finally:
        for s in servers.values():
            s.stop()
    finish(report, t0)
    write_report(report, out_path)
    print_summary(report)
    return 0


def print_summary(report: dict) -> None:
    """Each system's knee per regime, its unloaded latency beside it."""
    for regime, by_system in report.get("knees", {}).items():
        r = report["regimes"][regime]
        print(f"{regime} (TTFT <= {r['ttft_ms']} ms, TPOT <= {r['tpot_ms']} ms):")
        for system, knee in by_system.items():
            u = report["unloaded"].get(system, {})
            print(f"  {system:<36} knee {knee['text']:<70} unloaded TTFT {u.get('ttft_ms', float('nan')):.1f} ms, "
                  f"TPOT {u.get('tpot_ms', float('nan')):.2f} ms")
    if report.get("skipped"):
        print(f"skipped {len(report['skipped'])} point(s): --max-minutes reached")
    print(report["shared_machine_note"])


if __name__ == "__main__":
    sys.exit(main())
