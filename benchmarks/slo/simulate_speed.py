"""How fast `pdserve simulate` runs: a slice of the Mooncake conversation trace on W
workers (W/2 prefill + W/2 decode) for each W, wall and process-CPU seconds of the
simulation itself (trace loading excluded), and the extrapolation to the whole hour.

    python -m benchmarks.slo.simulate_speed [--trace ../shared/data/mooncake/conversation_trace.jsonl]
        [--latency-model examples/latency_model_gpu_illustrative.json] [--trace-scale 1]
        [--duration-s 300] [--workers 2,4,8,16] [--out results/simulate_speed.json]
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pdserve.common.latency_model import LatencyModel
from pdserve.router.cli import simulate as sim_cli

TRACE_HOUR_S = 3537.0  # the conversation trace's span


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default="/work/shared/data/mooncake/conversation_trace.jsonl")
    ap.add_argument("--latency-model", default="examples/latency_model_gpu_illustrative.json")
    ap.add_argument("--trace-scale", type=int, default=1)
    ap.add_argument("--duration-s", type=float, default=300.0)
    ap.add_argument("--workers", default="2,4,8,16")
    ap.add_argument("--num-blocks", type=int, default=20000)
    ap.add_argument("--out", default="results/simulate_speed.json")
    a = ap.parse_args()
    p = argparse.ArgumentParser()
    sim_cli.add_arguments(p)
    args = p.parse_args(["--trace", a.trace, "--latency-model", a.latency_model, "--trace-scale", str(a.trace_scale),
                         "--duration-s", str(a.duration_s), "--num-blocks", str(a.num_blocks),
                         "--slo-ttft-ms", "2000", "--slo-tpot-ms", "100"])
    model = LatencyModel.load(a.latency_model)
    t0 = time.perf_counter()
    requests = sim_cli.load_requests(args)
    load_s = time.perf_counter() - t0
    rows = []
    for w in [int(x) for x in a.workers.split(",")]:
        res = sim_cli.simulate(args, model, requests, sim_cli.deployment(args, w // 2, w - w // 2, 0), "always")
        sim = res["simulator"]
        row = {"workers": w, "deployment": res["deployment"], "requests": len(requests), "trace_s": a.duration_s,
               "simulated_s": sim["simulated_s"], "wall_s": sim["wall_s"], "cpu_s": sim["cpu_s"],
               "steps": sim["steps"], "output_tokens": res["total_output_tokens"],
               "slo_attainment": res["slo_attainment"], "median_ttft_ms": res["median_ttft_ms"],
               "median_tpot_ms": res["median_tpot_ms"],
               "hour_cpu_s_extrapolated": sim["cpu_s"] * TRACE_HOUR_S / a.duration_s}
        rows.append(row)
        print(json.dumps(row))
    out = {"trace": a.trace, "latency_model": a.latency_model, "trace_scale": a.trace_scale,
           "load_s": load_s, "runs": rows}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
