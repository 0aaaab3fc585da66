"""The simulator against a measured run: replay the exact requests and send times of a
`benchmarks/conditional_disagg.py` run (its JSON and the latency model it profiled)
through `pdserve simulate`'s code with the same split (1P + 1D), engine limits and
disaggregation modes, and put simulated and measured TTFT/TPOT p50/p90 side by side.

    python benchmarks/simulate_validate.py --measured DIR/conditional_disagg.json
        --latency-model DIR/latency_model.json [--out results/simulate_validate.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from conditional_disagg import workload  # noqa: E402
from servers import MAX_BATCHED, MAX_NUM_SEQS  # noqa: E402

from common.config import SchedulerConfig  # noqa: E402
from router.config import RouterConfig  # noqa: E402
from router.latency_model import LatencyModel  # noqa: E402
from router.simulate.sim import Deployment, Simulation  # noqa: E402

KV_BLOCKS = 2048  # benchmarks/servers.py's --num-kv-blocks


def _pct(xs: list[float]) -> dict[str, float]:
    a = np.asarray(xs) * 1000
    return {"p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measured", required=True)
    ap.add_argument("--latency-model", required=True)
    ap.add_argument("--out", default="results/simulate_validate.json")
    a = ap.parse_args()
    measured = json.loads(Path(a.measured).read_text())
    cfg = measured["config"]
    plan = workload(argparse.Namespace(**cfg), 32000)
    requests = [(t, r.prompt_token_ids, r.output_len) for r, t in plan]
    model = LatencyModel.load(a.latency_model)
    dep = Deployment(1, 1, 0, KV_BLOCKS, SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED))
    out = {"measured": a.measured, "latency_model": a.latency_model, "modes": {}}
    for mode, res in measured["results"].items():
        rc = RouterConfig(model_dir="simulated", disagg=mode, disagg_threshold_tokens=cfg["threshold"],
                          disagg_latency_model=a.latency_model, disagg_tpot_guard_ms=cfg["tpot_guard_ms"])
        reqs = Simulation(dep, model, rc).run(requests)
        sim = {"ttft_ms": _pct([r.record.ttft for r in reqs]),
               "tpot_ms": _pct([r.record.tpot for r in reqs if r.record.tpot is not None])}
        meas = {"ttft_ms": {k: res["ttft_all_ms"][k] for k in ("p50", "p90")},
                "tpot_ms": {k: res["tpot_ms"][k] for k in ("p50", "p90")}}
        ratio = {m: {p: sim[m][p] / meas[m][p] for p in ("p50", "p90")} for m in sim}
        out["modes"][mode] = {"simulated": sim, "measured": meas, "simulated_over_measured": ratio}
        print(mode, json.dumps(ratio))
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=2))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
