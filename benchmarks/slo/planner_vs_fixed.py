"""The SLO planner against every fixed split of the same cores, on a trace whose mix
shifts half-way (router/bench/shifting_trace.py: prompt-heavy, then decode-heavy).

    python -m benchmarks.slo.planner_vs_fixed [--model DIR] [--duration-s 120] [--rate 0.5]
        [--prompt-heavy 384,4] [--decode-heavy 48,48] [--window-s 15]
        [--out-dir results/planner_vs_fixed]

Method:
1. The trace: `shifting_mix(--duration-s, --seed)` written to --out-dir/shifting_trace.jsonl
   (lengths in trace units = model tokens x 32, as Mooncake's), read back with bench's
   Mooncake loader (--trace-scale 32: prompts of random tokens, no prefix shared).
2. Runs, one after the other, each on a fresh `pdserve serve` (benchmarks/harness/servers.py:
   float32, one host of os.cpu_count() cores):
   fixed  colocated x1 with 2 threads; 1P+1D with 1 thread each (every split of 2 cores);
   slo    for each SLO regime, `--planner slo --planner-host-cores 2` from colocated x1,
          at pdserve's shipped planner settings (or --planner-interval-s, --planner-sustain,
          --planner-cooldown-s).
   The same requests at the same send times (HTTP, timelines); during a planner run
   /metrics is polled every second and each rise of pdserve_planner_decisions_total
   with an action other than `none` is kept with its time.
   With --slo-scale k every SLO (the planner's and the judged) is k times the regime's.
3. A fixed split does not depend on the SLO, so its one run is judged under both
   regimes; a planner run only under its own. Per (config, regime): attainment (both
   SLOs met) and goodput (met requests per second of the run), overall and per
   --window-s window of send time, and the planner's decisions.
Writes --out-dir/planner_vs_fixed.json and planner_vs_fixed.png (attainment over time per
regime, planner decisions marked, the mix's shift as a dotted line).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness.paths import REPO

from benchmarks.harness.planner_watch import DecisionPoller
from benchmarks.harness.servers import log, start_pdserve

from pdserve.common.config import ModelConfig
from pdserve.router.stats.latency import RequestRecord, meets_slo
from pdserve.router.bench.runner import run_workload
from pdserve.router.bench.shifting_trace import Phase, shifting_mix, write_trace
from pdserve.router.bench.workloads import mooncake_workload

SCALE = 32  # trace units per model token
REGIMES = {"ttft1000_tpot100": (1000.0, 100.0), "ttft2000_tpot15": (2000.0, 15.0)}
FIXED = ("colocated", "1p1d")  # benchmarks/harness/servers.py configurations


def run(cfg: str, model: str, extra: list[str], reqs: list, workdir: Path, name: str
        ) -> tuple[list[RequestRecord], float, list]:
    """Serve the requests at their arrival times; (records, duration, planner decisions)."""
    server = start_pdserve(cfg, model, workdir, extra, name=name)
    try:
        load = os.getloadavg()[0]
        t0 = time.time()
        poller = DecisionPoller(server.url, t0)
        records, duration = asyncio.run(run_workload(reqs, "http", server.url, [r.arrival for r in reqs],
                                                     temperature=0.0, ignore_eos=True, progress=False))
        decisions = poller.stop()
        log(f"{name}: {len(records)} requests in {duration:.0f} s; load average {load:.1f} -> "
            f"{os.getloadavg()[0]:.1f}; planner decisions {decisions}")
    finally:
        server.stop()
    return records, duration, decisions


def judge(records: list[RequestRecord], sends: list[float], duration: float, slo: tuple[float, float],
          window_s: float) -> dict:
    """Attainment and goodput overall and per window of send time."""
    ttft_s, tpot_s = slo[0] / 1000, slo[1] / 1000
    met = [meets_slo(r, ttft_s, tpot_s) for r in records]
    windows = []
    end = max(sends) if sends else 0.0
    start = 0.0
    while start <= end:
        idx = [i for i, t in enumerate(sends) if start <= t < start + window_s]
        if idx:
            k = sum(met[i] for i in idx)
            windows.append({"t_s": start, "n": len(idx), "attainment": k / len(idx), "goodput_req_s": k / window_s})
        start += window_s
    return {"attainment": sum(met) / len(met) if met else 0.0, "goodput_req_s": sum(met) / duration if duration else 0.0,
            "requests": len(records), "duration_s": duration, "windows": windows}


def plot(results: dict, slos: dict, shift_s: float, window_s: float, out: Path) -> Path:
    """Attainment (top) and goodput (bottom) per window, one column per regime."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7), sharex=True, squeeze=False)
    for col, (regime, runs) in enumerate(results.items()):
        ttft, tpot = slos[regime]
        top, bottom = axes[0][col], axes[1][col]
        for cfg, res in runs.items():
            xs = [x["t_s"] + window_s / 2 for x in res["windows"]]
            line, = top.plot(xs, [x["attainment"] * 100 for x in res["windows"]], marker="o",
                             label=f"{cfg}: {res['attainment']:.0%}, {res['goodput_req_s']:.2f} req/s")
            bottom.plot(xs, [x["goodput_req_s"] for x in res["windows"]], marker="o", color=line.get_color())
            for d in res.get("decisions", []):
                for ax in (top, bottom):
                    ax.axvline(d["t_s"], color=line.get_color(), linestyle="--", linewidth=1)
                top.annotate(d["action"], (d["t_s"], 100), fontsize=7, color=line.get_color(), rotation=90,
                             va="top", ha="right")
        for ax in (top, bottom):
            ax.axvline(shift_s, color="gray", linestyle=":", linewidth=1)
            ax.grid(alpha=0.3)
        top.set_title(f"TTFT <= {ttft:g} ms, TPOT <= {tpot:g} ms (dotted: mix shifts; dashed: planner)", fontsize=9)
        top.set_ylim(0, 105)
        top.legend(fontsize=7)
        bottom.set_xlabel("send time (s)")
    axes[0][0].set_ylabel("SLO attainment per window (%)")
    axes[1][0].set_ylabel("goodput per window (req/s)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _pair(text: str) -> tuple[int, int]:
    a, b = (int(x) for x in text.split(","))
    return a, b


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    p.add_argument("--duration-s", type=float, default=120.0, help="the trace's length (s)")
    p.add_argument("--rate", type=float, default=0.5, help="arrivals per second, both halves")
    p.add_argument("--prompt-heavy", type=_pair, default=(384, 4), help="first half: input,output tokens")
    p.add_argument("--decode-heavy", type=_pair, default=(48, 48), help="second half: input,output tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window-s", type=float, default=15.0)
    p.add_argument("--planner-interval-s", type=float, default=None, help="default: pdserve's shipped default")
    p.add_argument("--planner-sustain", type=int, default=None, help="default: pdserve's shipped default")
    p.add_argument("--planner-cooldown-s", type=float, default=None, help="default: pdserve's shipped default")
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--slo-scale", type=float, default=1.0, help="both SLOs of every regime x this (a machine this "
                                                               "much slower than the one the regimes are for)")
    p.add_argument("--out-dir", default=str(REPO / "results/planner_vs_fixed"))
    return p.parse_args()


def main() -> int:
    args = parse()
    out_dir = Path(args.out_dir)
    rows = shifting_mix(args.duration_s, args.seed, Phase(args.prompt_heavy[0] * SCALE, args.prompt_heavy[1] * SCALE,
                                                          args.rate),
                        Phase(args.decode_heavy[0] * SCALE, args.decode_heavy[1] * SCALE, args.rate))
    trace = write_trace(out_dir / "shifting_trace.jsonl", rows)
    reqs = mooncake_workload(trace, len(rows), SCALE, ModelConfig.from_dir(args.model).vocab_size, seed=args.seed)
    shift = args.duration_s / 2 - rows[0]["timestamp"] / 1000
    sends = [r.arrival for r in reqs]
    regimes = [r for r in args.regimes.split(",") if r]
    slos = {r: (REGIMES[r][0] * args.slo_scale, REGIMES[r][1] * args.slo_scale) for r in regimes}
    results: dict = {r: {} for r in regimes}
    loads = {}
    with tempfile.TemporaryDirectory(prefix="planner-vs-fixed-") as tmp:
        for cfg in FIXED:
            loads[cfg] = os.getloadavg()
            records, duration, _ = run(cfg, args.model, [], reqs, Path(tmp), f"pdserve-{cfg}")
            for regime in regimes:
                results[regime][cfg] = judge(records, sends, duration, slos[regime], args.window_s)
        for regime in regimes:
            ttft, tpot = slos[regime]
            extra = ["--planner", "slo", "--slo-ttft-ms", str(ttft), "--slo-tpot-ms", str(tpot), "--planner-host-cores", "2"]
            for flag in ("interval_s", "sustain", "cooldown_s"):
                if getattr(args, f"planner_{flag}") is not None:
                    extra += [f"--planner-{flag.replace('_', '-')}", str(getattr(args, f"planner_{flag}"))]
            loads[f"planner_{regime}"] = os.getloadavg()
            records, duration, decisions = run("colocated", args.model, extra, reqs, Path(tmp), f"pdserve-planner-{regime}")
            results[regime]["planner (from colocated)"] = dict(judge(records, sends, duration, slos[regime],
                                                                    args.window_s), decisions=decisions)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": {k: v for k, v in vars(args).items()},
           "machine": {"cores": os.cpu_count(), "load_average_1_5_15_before_each_run": loads},
           "trace": {"path": str(trace), "requests": len(reqs), "shift_s": shift,
                     "mean_input": {h: sum(r.prompt_len for r in part) / max(1, len(part)) for h, part in
                                    (("first", [r for r in reqs if r.arrival < shift]),
                                     ("second", [r for r in reqs if r.arrival >= shift]))}},
           "slos_ms": slos, "results": results}
    (out_dir / "planner_vs_fixed.json").write_text(json.dumps(out, indent=2))
    plot(results, slos, shift, args.window_s, out_dir / "planner_vs_fixed.png")
    for regime, res in results.items():
        log(f"{regime}: " + "; ".join(f"{c} attainment {r['attainment']:.0%} goodput {r['goodput_req_s']:.2f} req/s"
                                      for c, r in res.items()))
    log(f"wrote {out_dir / 'planner_vs_fixed.json'} and planner_vs_fixed.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
