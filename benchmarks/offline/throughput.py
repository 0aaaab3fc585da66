"""Offline throughput: our `LLM.generate` against transformers' batched `generate`,
side by side in one run on the same prompts, plus the share of an engine step spent
outside the model forward at batch 32.

    python -m benchmarks.offline.throughput [--model DIR] [--num-prompts 64]
        [--hf-batch-size 16] [--repeats 1] [--out results/offline_throughput.json] [--profile]

Each engine is measured in a fresh child process (this script with `--child`), one after
the other, so neither inherits the other's allocator state, threads or caches. With
`--repeats N` the engines alternate N times; the report gives the median run of each and
the median of the per-pair ratios (all runs are in the JSON under "runs").

Workload: `--num-prompts` prompts of random token ids in [3, vocab) (0-2 are special),
input lengths uniform in [32, 512], output lengths uniform in [16, 256], fixed seed;
greedy with ignore_eos, so every prompt yields exactly its output length.

Counting. Ours: total generated tokens / wall time of one `generate` over all prompts
(a 2-prompt warm-up runs first and is not counted). transformers: prompts are sorted by
input length (longest first) and cut into batches of `--hf-batch-size`, so each batch
holds similar lengths and little left padding -- the order most favourable to it. A
batch runs `max_new_tokens = min_new_tokens =` its longest output length (static
batching cannot stop a row early), and only the useful tokens, each prompt's own output
length, count towards its tokens/s.

Overhead at batch 32 (step_overhead.py): 32 sequences are prefilled, then each
`engine.step()` of pure decode is timed together with the time inside
`runner.model.forward`; overhead share = 1 - forward_time / step_time. `--profile` then
runs cProfile over further decode steps and prints the top functions.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may reach a model hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch
from tqdm.auto import tqdm

from benchmarks.harness.models import ensure_model
from benchmarks.harness.paths import REPO

from pdserve.common import LLM, SamplingParams
from benchmarks.harness.timing import Phase, Throughput
from benchmarks.offline.step_overhead import measure_overhead

NUM_THREADS = 2
BLOCK_SIZE = 16
MAX_MODEL_LEN = 1024
FIRST_TOKEN_ID = 3  # ids 0-2 are the tokenizer's special tokens
TARGET_RATIO = 2.0
TARGET_OVERHEAD = 0.10
CONTENDED_SHARE = 0.05  # other processes' share of the machine's CPU above which timings are suspect


@dataclass(frozen=True)
class Workload:
    """The prompts (token ids) and each prompt's exact output length."""

    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def total_output(self) -> int:
        return sum(self.output_lens)


def make_workload(n: int, vocab: int, seed: int, in_range: tuple[int, int] = (32, 512),
                  out_range: tuple[int, int] = (16, 256)) -> Workload:
    rng = random.Random(seed)
    prompts, outs = [], []
    for _ in range(n):
        prompts.append([rng.randrange(FIRST_TOKEN_ID, vocab) for _ in range(rng.randint(*in_range))])
        outs.append(rng.randint(*out_range))
    return Workload(prompts, outs)


def kv_blocks_for(work: Workload) -> int:
    """Blocks for every prompt at its full length at once: no preemption can occur."""
    return sum(-(-(len(p) + o) // BLOCK_SIZE) for p, o in zip(work.prompts, work.output_lens)) + 1


# ---- our engine ------------------------------------------------------------------
def run_ours(llm: LLM, work: Workload) -> Throughput:
    warm = [p[:64] for p in work.prompts[:2]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in work.output_lens]
    with Phase() as phase:
        outs = llm.generate(work.prompts, params)
    got = [len(o["token_ids"]) for o in outs]
    if got != work.output_lens:
        raise RuntimeError("our engine did not produce exactly max_tokens per prompt (ignore_eos)")
    return phase.result(sum(got))


# ---- transformers baseline ---------------------------------------------------------
def run_transformers(model_dir: Path, work: Workload, batch_size: int) -> Throughput:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    if pad is None:
        raise SystemExit(f"{model_dir}/config.json has no pad_token_id; transformers' batched generate needs one")
    order = sorted(range(len(work.prompts)), key=lambda i: -len(work.prompts[i]))
    batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]

    def generate(rows: list[list[int]], new: int) -> torch.Tensor:
        width = max(len(r) for r in rows)
        ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])  # left padding
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.inference_mode():
            return model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                                  do_sample=False, pad_token_id=pad)

    generate([p[:64] for p in work.prompts[:2]], 8)  # warm-up, not counted
    useful = 0
    with Phase() as phase:
        for b in tqdm(batches, desc=f"transformers (batch {batch_size})", dynamic_ncols=True):
            new = max(work.output_lens[i] for i in b)
            out = generate([work.prompts[i] for i in b], new)
            if out.shape[1] - max(len(work.prompts[i]) for i in b) != new:
                raise RuntimeError("transformers stopped before min_new_tokens")
            useful += sum(work.output_lens[i] for i in b)
    return phase.result(useful)


# ---- report ------------------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import transformers
    return {"platform": platform.platform(), "python": platform.python_version(), "cpu": cpu,
            "cpu_count": os.cpu_count(), "torch": torch.__version__, "transformers": transformers.__version__,
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads()}


def print_table(report: dict[str, Any]) -> None:
    ours, hf, ov = report["ours"], report["transformers"], report["overhead_at_batch32"]
    print()
    print(f"{'engine':<14}{'out tokens':>12}{'seconds':>10}{'tok/s':>10}{'cpu s':>10}{'others cpu':>12}")
    for name, r in (("pdserve", ours), ("transformers", hf)):
        other = "-" if r["other_cpu_share"] is None else f"{r['other_cpu_share']:.0%}"
        print(f"{name:<14}{r['output_tokens']:>12}{r['seconds']:>10.2f}{r['tokens_per_s']:>10.1f}"
              f"{r['cpu_seconds']:>10.1f}{other:>12}")
    t = report["targets"]
    print(f"ratio ours/transformers: {report['ratio']:.2f}x  (target >= {t['ratio']['target']}: "
          f"{'met' if t['ratio']['met'] else 'NOT met'}); by CPU time: {report['ratio_by_cpu_time']:.2f}x")
    print(f"step at batch {ov['batch']}: {ov['step_ms_mean']:.2f} ms, forward {ov['forward_ms_mean']:.2f} ms, "
          f"lm_head {ov['compute_logits_ms_mean']:.2f} ms")
    print(f"overhead share at batch {ov['batch']}: {ov['overhead_share']:.1%} "
          f"(lm_head as model: {ov['overhead_share_counting_lm_head_as_model']:.1%})  "
          f"(target <= {t['overhead_share']['target']:.0%}: {'met' if t['overhead_share']['met'] else 'NOT met'})")
    if report["contended"]:
        print(f"WARNING: other processes used up to {report['max_other_cpu_share']:.0%} of the machine's "
              f"CPU during a timed phase: timings are not clean")
    if ov["profile_top"]:
        print(f"\ncProfile, top functions by own time per decode step (batch {ov['batch']}):")
        for r in ov["profile_top"][:15]:
            print(f"  {r['tottime_ms_per_step']:7.3f} ms  {r['ncalls']:>7}  {r['function']}")


def run_child(kind: str, args: argparse.Namespace, model_dir: Path, overhead: bool) -> dict[str, Any]:
    """Measure one engine in a fresh process (this script with --child); returns its JSON.
    Fresh processes keep one engine's allocator state, threads and caches from touching
    the other's timing, whichever runs first."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, "-m", "benchmarks.offline.throughput", "--child", kind, "--child-out", str(out),
               "--model", str(model_dir), "--num-prompts", str(args.num_prompts), "--seed", str(args.seed),
               "--hf-batch-size", str(args.hf_batch_size), "--out", args.out,
               "--overhead-steps", str(args.overhead_steps if overhead else 0), "--dtype", args.dtype]
        if args.profile and overhead:
            cmd.append("--profile")
        subprocess.run(cmd, check=True, cwd=REPO)
        return json.loads(out.read_text())


def child_main(args: argparse.Namespace) -> None:
    """--child ours|transformers: one measurement, written to --child-out."""
    torch.set_num_threads(NUM_THREADS)
    model_dir = Path(args.model)
    work = make_workload(args.num_prompts, json.loads((model_dir / "config.json").read_text())["vocab_size"],
                         args.seed)
    result: dict[str, Any] = {}
    if args.child == "ours":
        llm = LLM(model_dir, max_model_len=MAX_MODEL_LEN, max_num_seqs=64, max_num_batched_tokens=2048,
                  block_size=BLOCK_SIZE, num_kv_blocks=kv_blocks_for(work), num_threads=NUM_THREADS,
                  dtype=args.dtype)
        result["throughput"] = run_ours(llm, work).as_dict()
        if args.overhead_steps:
            prof = Path(args.out).with_suffix(".prof") if args.profile else None
            result["overhead"] = measure_overhead(llm, work.prompts[:32], MAX_MODEL_LEN, args.overhead_steps,
                                                  32 if args.profile else 0, prof)
    else:
        result["throughput"] = run_transformers(model_dir, work, args.hf_batch_size).as_dict()
    Path(args.child_out).write_text(json.dumps(result))


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="HuggingFace-format model dir (default: make the small qwen3 model)")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="pdserve's dtype (float32, bfloat16, auto)")
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1,
                    help="measure each engine this many times, alternating; report medians")
    ap.add_argument("--overhead-steps", type=int, default=64, help="timed decode steps at batch 32")
    ap.add_argument("--profile", action="store_true", help="cProfile 32 more decode steps at batch 32")
    ap.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline (no ratio)")
    ap.add_argument("--out", default=str(REPO / "results" / "offline_throughput.json"))
    ap.add_argument("--child", choices=["ours", "transformers"], help=argparse.SUPPRESS)
    ap.add_argument("--child-out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child_main(args)
    if args.num_prompts < 32 or args.hf_batch_size < 1 or args.repeats < 1 or args.overhead_steps < 1:
        ap.error("--num-prompts must be >= 32 (the overhead phase runs 32); --hf-batch-size, --repeats and "
                 "--overhead-steps >= 1")

    torch.set_num_threads(NUM_THREADS)  # as in the children, so machine_info reports it
    model_dir = ensure_model(args.model)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    work = make_workload(args.num_prompts, vocab, args.seed)
    config = {"model": str(model_dir), "num_prompts": args.num_prompts, "seed": args.seed,
              "input_len_range": [32, 512], "output_len_range": [16, 256],
              "total_input_tokens": sum(map(len, work.prompts)), "total_output_tokens": work.total_output,
              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 64, "max_num_batched_tokens": 2048,
              "block_size": BLOCK_SIZE, "num_kv_blocks": kv_blocks_for(work), "hf_batch_size": args.hf_batch_size,
              "hf_batch_order": "sorted by input length, longest first; max/min_new_tokens = batch max",
              "hf_counted_tokens": "useful only: sum of each prompt's own output length",
              "repeats": args.repeats, "isolation": "each measurement in a fresh process, alternating engines"}

    ours_runs: list[dict[str, Any]] = []
    hf_runs: list[dict[str, Any]] = []
    pair_ratios: list[float] = []
    overhead: dict[str, Any] = {}
    for rep in range(args.repeats):
        res = run_child("ours", args, model_dir, overhead=rep == 0)
        ours_runs.append(res["throughput"])
        overhead = res.get("overhead", overhead)
        if not args.skip_hf:
            hf_runs.append(run_child("transformers", args, model_dir, overhead=False)["throughput"])
            pair_ratios.append(ours_runs[-1]["tokens_per_s"] / hf_runs[-1]["tokens_per_s"])
    ours, hf = median_run(ours_runs), median_run(hf_runs) if hf_runs else None

    ratio = statistics.median(pair_ratios) if pair_ratios else None
    # Same ratio over process CPU seconds: a cross-check that other processes taking the
    # cores (which stretches wall time, not CPU time) barely moves.
    ratio_cpu = statistics.median(
        (o["output_tokens"] / o["cpu_seconds"]) / (h["output_tokens"] / h["cpu_seconds"])
        for o, h in zip(ours_runs, hf_runs)) if hf_runs else None
    shares = [r["other_cpu_share"] for r in ours_runs + hf_runs if r["other_cpu_share"] is not None]
    if overhead.get("other_cpu_share") is not None:
        shares.append(overhead["other_cpu_share"])
    report = {
        "config": config,
        "ours": ours,
        "transformers": hf,
        "ratio": ratio,
        "ratio_by_cpu_time": ratio_cpu,
        "runs": {"ours": ours_runs, "transformers": hf_runs, "pair_ratios": pair_ratios},
        "overhead_share_at_batch32": overhead["overhead_share"],
        "overhead_at_batch32": overhead,
        "targets": {
            "ratio": {"target": TARGET_RATIO, "met": ratio is not None and ratio >= TARGET_RATIO},
            "overhead_share": {"target": TARGET_OVERHEAD, "met": overhead["overhead_share"] <= TARGET_OVERHEAD},
        },
        "max_other_cpu_share": max(shares, default=None),
        "contended": max(shares, default=0.0) > CONTENDED_SHARE,
        "torch_threads": NUM_THREADS,
        "machine": machine_info(),
    }
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2))
    if hf:
        print_table(report)
    else:
        print(json.dumps({k: report[k] for k in ("ours", "overhead_share_at_batch32")}, indent=2))
    print(f"\nwrote {out_path}")


if __name__ == "__main__":
    main()
