"""One serving point of this tree against another checkout, side by side in one run.

    python -m benchmarks.serving.ab_checkout --baseline /work/wt-base [--baseline-module router.cli]
        [--config colocated] [--rate 2] [--num-prompts 100] [--rounds 3] [--out results/ab_checkout.json]

Each round starts this tree's `pdserve serve` and the baseline checkout's in turn (the same
config, model, dtype and flags; `--baseline-module router.cli` for a checkout from before the
code moved under pdserve/), drives each with this tree's `pdserve bench` (HTTP, random
prompts of 256 tokens +-, 64 out, the same seed for both in a round, a new seed each round)
at one request rate, and stops it. Reported: each side's median over rounds of mean / p99
TTFT and TPOT and the output tokens per second, and baseline over this tree (above 1: this
tree is faster). What it answers: did a change to the serving path (a restructure, say)
move its latency, on the same machine in the same minutes.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.harness.facts import run_facts
from benchmarks.harness.models import ensure_model
from benchmarks.harness.output import write_report
from benchmarks.harness.paths import REPO, RESULTS
from benchmarks.harness.servers import PDSERVE_CONFIGS, log, start_pdserve

KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "output_throughput")


def bench(url: str, model: str, rate: float, n: int, seed: int, out: Path) -> dict:
    """This tree's `pdserve bench` against `url`: the point's JSON."""
    cmd = [sys.executable, "-m", "pdserve", "bench", "--backend", "http", "--url", url, "--model", model,
           "--num-prompts", str(n), "--input-len", "256", "--output-len", "64", "--request-rate", str(rate),
           "--seed", str(seed), "--out", str(out), "--no-progress"]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    point = json.loads(out.read_text())  # bench exits non-zero (check=True raises) when a request failed
    return {k: point[k] for k in KEYS}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="another checkout of pdserve (a git worktree)")
    ap.add_argument("--baseline-module", default="pdserve", help="its command's module (router.cli before pdserve/)")
    ap.add_argument("--model", default=None, help="model dir (default: the small qwen3, made if missing)")
    ap.add_argument("--config", default="colocated", choices=sorted(PDSERVE_CONFIGS))
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(RESULTS / "ab_checkout.json"))
    args = ap.parse_args()
    model = str(ensure_model(args.model))
    logdir = RESULTS / "logs" / "ab_checkout"
    logdir.mkdir(parents=True, exist_ok=True)
    sides = {"this": (REPO, "pdserve"), "baseline": (Path(args.baseline).resolve(), args.baseline_module)}
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for rnd in range(args.rounds):
        for side, (repo, module) in sides.items():
            server = start_pdserve(args.config, model, logdir, repo=repo, module=module, name=f"{side}-{rnd}")
            try:
                runs[side].append(bench(server.url, model, args.rate, args.num_prompts, rnd,
                                        logdir / f"{side}-{rnd}.json"))
            finally:
                server.stop()
            log(f"round {rnd + 1}: {side} {runs[side][-1]}")
    med = {side: {k: statistics.median(r[k] for r in rs) for k in KEYS} for side, rs in runs.items()}
    ratios = {k: med["baseline"][k] / med["this"][k] for k in KEYS if k != "output_throughput"}
    ratios["output_throughput"] = med["this"]["output_throughput"] / med["baseline"]["output_throughput"]
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=sides["baseline"][0], capture_output=True,
                            text=True).stdout.strip()
    report = {**run_facts(), "what": "one serving point, this tree against another checkout",
              "baseline": {"path": str(sides["baseline"][0]), "commit": commit, "module": args.baseline_module},
              "model": model, "config": args.config, "dtype": "float32", "rate": args.rate,
              "num_prompts": args.num_prompts, "rounds": args.rounds, "median": med,
              "baseline_over_this": ratios, "runs": runs}
    print(json.dumps({"median": med, "baseline_over_this (throughput: this over baseline)": ratios}, indent=1))
    write_report(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
