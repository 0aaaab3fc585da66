"""The simulator's pick of a split against the best measured one, on the same trace:
every fixed split of benchmarks/slo/planner_vs_fixed.py (colocated x1 on 2 threads, 1P+1D on 1
thread each) simulated on that run's trace with the latency model profiled for its layout
(benchmarks/slo/simulate_validate.py's JSON holds one per layout), judged under the same SLOs,
ranked by goodput then attainment, beside the measured ranking.

    python -m benchmarks.slo.simulated_split_pick --measured DIR/planner_vs_fixed.json
        --models VALIDATE.json [--out DIR/simulated_split_pick.json]

`--validation FILE[,FILE]` ranks the deployments of benchmarks/slo/simulate_validate.py runs
instead (a later file's deployment replaces an earlier one's): per SLO pair, by the
attainment simulated with the host's CPU and by the attainment of each served run (one
load at one rate, so goodput ranks as attainment does), and says how far the simulated
pick's served attainment is from the best one's.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


from benchmarks.slo.planner_vs_fixed import SCALE, judge
from benchmarks.harness.servers import MAX_BATCHED, MAX_NUM_SEQS
from benchmarks.slo.simulate_validate import KV_BLOCKS, LAYOUTS

from pdserve.common.config import ModelConfig, SchedulerConfig
from pdserve.router.bench.workloads import mooncake_workload
from pdserve.router.core.config import RouterConfig
from pdserve.common.latency_model import LatencyModel
from pdserve.router.simulate.sim import Deployment, Simulation


def simulate(cfg: str, model: LatencyModel, reqs: list) -> tuple[list, float]:
    p, d, c, threads = LAYOUTS[cfg]
    dep = Deployment(p, d, c, KV_BLOCKS, SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED),
                     threads=threads, host_cores=os.cpu_count() or 1)
    done = Simulation(dep, model, RouterConfig(model_dir="simulated")).run(
        [(r.arrival, r.prompt_token_ids, r.output_len) for r in reqs])
    records = [r.record for r in done]
    span = max(t for r in records for t in r.token_times[-1:]) - min(r.send_time for r in records)
    return records, span


def best(figs: dict[str, dict]) -> str:
    """The config with the most goodput, then attainment."""
    return max(figs, key=lambda c: (figs[c]["goodput_req_s"], figs[c]["attainment"]))


def validation_picks(paths: list[str]) -> dict:
    """Per SLO pair of simulate_validate.py reports: the simulated pick, each served run's
    best, and the pick's served attainment over the best's, run by run."""
    deps: dict[str, dict] = {}
    for path in paths:
        deps.update(json.loads(Path(path).read_text())["deployments"])
    runs = min(1 + len(d.get("repeats", [])) for d in deps.values())
    out: dict = {"validation": paths, "regimes": {}}
    for key in deps[next(iter(deps))]["measured"]["attainment"]:
        sim = {c: d["simulated_host_cpu"]["attainment"][key] for c, d in deps.items()}
        served = [{c: ([d["measured"]] + d.get("repeats", []))[k]["attainment"][key] for c, d in deps.items()}
                  for k in range(runs)]
        pick = max(sim, key=sim.get)
        out["regimes"][key] = {"simulated": sim, "served": served, "simulated_pick": pick,
                               "served_best": [max(s, key=s.get) for s in served],
                               "pick_over_best": [s[pick] / max(s.values()) if max(s.values()) else None
                                                  for s in served]}
        r = out["regimes"][key]
        print(f"{key}: simulated pick {pick}; served best {r['served_best']}; the pick's served attainment over "
              f"the best's {[round(x, 3) if x is not None else None for x in r['pick_over_best']]}; "
              + "; ".join(f"{c}: sim {sim[c]:.2f}, served {[round(s[c], 2) for s in served]}" for c in sim))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--measured", help="planner_vs_fixed.json")
    ap.add_argument("--models", help="simulate_validate.json (its per-layout latency models)")
    ap.add_argument("--validation", default="", help="FILE[,FILE]: rank simulate_validate.py reports' deployments")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    if a.validation:
        path = Path(a.out or "results/simulated_split_pick_validation.json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(validation_picks(a.validation.split(",")), indent=2))
        print(f"wrote {path}")
        return 0
    if not (a.measured and a.models):
        ap.error("--measured and --models (or --validation)")
    measured = json.loads(Path(a.measured).read_text())
    models = json.loads(Path(a.models).read_text())["deployments"]
    cfg = measured["config"]
    reqs = mooncake_workload(measured["trace"]["path"], measured["trace"]["requests"], SCALE,
                             ModelConfig.from_dir(cfg["model"]).vocab_size, seed=cfg["seed"])
    sends = [r.arrival for r in reqs]
    runs = {c: simulate(c, LatencyModel.from_json(models[c]["latency_model"]), reqs) for c in ("colocated", "1p1d")}
    out: dict = {"measured": a.measured, "models": a.models, "regimes": {}}
    for regime, slo in measured["slos_ms"].items():
        sim = {c: {k: v for k, v in judge(recs, sends, span, tuple(slo), cfg["window_s"]).items() if k != "windows"}
               for c, (recs, span) in runs.items()}
        meas = {c: {k: measured["results"][regime][c][k] for k in ("attainment", "goodput_req_s")} for c in runs}
        out["regimes"][regime] = {"slo_ms": slo, "simulated": sim, "measured": meas,
                                  "simulated_pick": best(sim), "measured_best": best(meas)}
        print(f"{regime}: simulated pick {best(sim)}, measured best {best(meas)}; "
              + "; ".join(f"{c}: sim {sim[c]['attainment']:.0%} / {sim[c]['goodput_req_s']:.2f} req/s, meas "
                          f"{meas[c]['attainment']:.0%} / {meas[c]['goodput_req_s']:.2f} req/s" for c in runs))
    path = Path(a.out or Path(a.measured).with_name("simulated_split_pick.json"))
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
