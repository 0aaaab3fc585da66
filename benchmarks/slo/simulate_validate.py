"""The simulator against measured runs on this machine, one deployment at a time, each
profiled immediately before it is measured (a shared machine's load drifts: a latency
model from another moment is another machine).

    python -m benchmarks.slo.simulate_validate [--model DIR] [--configs colocated,1p1d,2p1d]
        [--requests 16] [--rate 0.5] [--out results/simulate_validate.json]

Per deployment (benchmarks/harness/servers.py: `--dtype` (float32), --num-kv-blocks 2048; colocated: one
worker of 2 threads; 1p1d and 2p1d: one thread per worker), in order:
1. the deployment starts and stands idle;
2. `pdserve profile` runs beside it with one worker's engine flags, threads included
   (the worker processes exist, as in the run): this moment's latency model;
3. the router's idle CPU is measured (`IDLE_WINDOW_S`, before and after serving); the
   Mooncake trace slice of benchmarks/slo/conditional_disagg.py (`--requests` rows, ties
   spread, compressed to `--rate` req/s) is served over HTTP with timelines, `--repeats`
   times (the same lengths, prefix sharing and send times; token values from seed,
   seed+1, ...: no prefix hits across repeats);
   then (unless --no-bracket) the deployment idles again and is profiled a second time:
   the latency model is the mean of the two (curves point by point, the decode step
   fitted to both sample sets), bracketing the run against a load that drifts;
4. the same requests at the same send times go through `pdserve simulate`'s code with
   the same split, engine limits, threads per worker and host cores (os.cpu_count()):
   once as it is, once with the CPU the router process (net of its idle CPU, which
   lands on a free core, not on a step) and this client spent per streamed token in the
   served runs (`--host-cpu-per-token-ms`: a step whose workers' threads fill the cores
   waits for it).
Reported per deployment: that CPU per token (router raw and net, client); TTFT / TPOT
p50 and p90 simulated (both ways), measured (the first run) and their ratio; with
repeats, each later run's figures over the first's (the noise floor: the same load
served again); per TPOT SLO, how many requests missed it in the simulated run (and in
each repeat), in the first served run, and in both (`over_tpot_slo`: whether the same
requests stalled, which a p90 on the knee of bimodal TPOTs does not say);
attainment at each SLO pair; and the per-request components both timelines have
(medians, ms): queue (arrival -> prefill start; a busy worker reads its socket only
between steps, so in a served timeline the wait lands in router in (arrival -> prefill
queued), in a simulated one in prefill queue), router in, prefill queue, prefill, KV
transfer, decode queue (KV ready -> first token), server TPOT ((finish - first token) /
(tokens - 1)), and what the client sees beyond the server (TTFT and TPOT overheads:
HTTP, router relay, detokenization); and per request, both runs' TTFT, TPOT, queue and
prefill (s). Writes --out (JSON). `--resimulate FILE[,FILE]` serves nothing: it simulates
the runs stored in earlier --out files again with this checkout's simulator.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.harness.paths import REPO

from benchmarks.slo.conditional_disagg import TRACE, workload
from benchmarks.harness.servers import MAX_BATCHED, MAX_MODEL_LEN, MAX_NUM_SEQS, log, start_pdserve

from benchmarks.harness.output import write_report
from pdserve.common.config import ModelConfig, SchedulerConfig
from pdserve.router.stats.latency import RequestRecord, attainment
from pdserve.router.bench.runner import run_workload
from pdserve.router.core.config import RouterConfig
from pdserve.common.latency_model import Curve, DecodeFit, LatencyModel
from pdserve.router.simulate.sim import Deployment, Simulation

KV_BLOCKS = 2048  # benchmarks/harness/servers.py's --num-kv-blocks
PLAN_KEYS = ("model", "requests", "rate", "trace_start", "max_input", "max_output", "seed", "trace")
IDLE_WINDOW_S = 10.0  # the router's idle CPU is measured over this long before and after serving
LAYOUTS = {"colocated": (0, 0, 1, 2), "1p1d": (1, 1, 0, 1), "2p1d": (2, 1, 0, 1)}  # P, D, C, threads per worker
SLOS = ((1000.0, 100.0), (2000.0, 15.0))  # (TTFT ms, TPOT ms)
COMPONENTS = (("queue", "arrival", "prefill_start"), ("router_in", "arrival", "prefill_queued"),
              ("prefill_queue", "prefill_queued", "prefill_start"),
              ("prefill", "prefill_start", "prefill_end"), ("kv_transfer", "prefill_end", "kv_ready"),
              ("decode_queue", "kv_ready", "first_token"))
PROFILE_SIZES = ["--prefill-tokens", "16,64,256,1023", "--batches", "1,4,8", "--contexts", "64,512", "--reps", "2"]


def profile(model: str, threads: int, out: Path, device: str = "cpu", dtype: str = "float32") -> LatencyModel:
    """`pdserve profile` with a worker's engine flags (benchmarks/harness/servers.py)."""
    cmd = [sys.executable, "-m", "pdserve", "profile", model, "--out", str(out), "--num-threads", str(threads),
           "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
           "--max-num-batched-tokens", str(MAX_BATCHED), "--dtype", dtype, "--device", device, *PROFILE_SIZES]
    t0 = time.monotonic()
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    log(f"profile ({threads} threads): {time.monotonic() - t0:.0f} s")
    return LatencyModel.load(out)


def mean_model(a: LatencyModel, b: LatencyModel) -> LatencyModel:
    """Two profiles of the same sizes as one: curves averaged point by point, the decode
    step fitted to both profiles' samples."""
    def mean(x: Curve, y: Curve) -> Curve:
        return Curve(tuple((n, (s + t) / 2) for (n, s), (_, t) in zip(x.points, y.points)))
    samples = a.decode_samples + b.decode_samples
    return LatencyModel(mean(a.prefill, b.prefill), DecodeFit.fit(list(samples)), mean(a.transfer, b.transfer),
                        dict(a.meta, bracketed=True), samples)


def _pct(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"n": 0, "p50": None, "p90": None}
    a = np.asarray(xs) * 1000
    return {"n": len(xs), "p50": float(np.percentile(a, 50)), "p90": float(np.percentile(a, 90))}


def _server_tpot(r: RequestRecord) -> float | None:
    t = r.timeline or {}
    if r.output_len < 2 or "finish" not in t or "first_token" not in t:
        return None
    return (t["finish"] - t["first_token"]) / (r.output_len - 1)


def components(records: list[RequestRecord]) -> dict[str, dict]:
    """Per-request durations both timelines have, and the client's view beyond the server's."""
    ok = [r for r in records if r.success and r.timeline]
    out = {name: _pct([r.timeline[b] - r.timeline[a] for r in ok if a in r.timeline and b in r.timeline])
           for name, a, b in COMPONENTS}
    out["server_tpot"] = _pct([x for r in ok if (x := _server_tpot(r)) is not None])
    out["client_ttft_overhead"] = _pct([r.ttft - (r.timeline["first_token"] - r.timeline["arrival"])
                                        for r in ok if r.ttft is not None and "first_token" in r.timeline])
    out["client_tpot_overhead"] = _pct([r.tpot - x for r in ok if r.tpot is not None
                                        and (x := _server_tpot(r)) is not None])
    return out


def _span(r: RequestRecord, a: str, b: str) -> float | None:
    t = r.timeline or {}
    return t[b] - t[a] if a in t and b in t else None


def per_request(records: list[RequestRecord]) -> dict[str, list]:
    return {"prompt_len": [r.prompt_len for r in records], "ttft_s": [r.ttft for r in records],
            "tpot_s": [r.tpot for r in records], "queue_s": [_span(r, "arrival", "prefill_start") for r in records],
            "prefill_s": [_span(r, "prefill_start", "prefill_end") for r in records]}


def figures(records: list[RequestRecord]) -> dict:
    ok = [r for r in records if r.success and r.ttft is not None]
    return {"per_request": per_request(records), "ttft_ms": _pct([r.ttft for r in ok]), "tpot_ms": _pct([r.tpot for r in ok if r.tpot is not None]),
            "attainment": {f"ttft{t:g}_tpot{p:g}": attainment(records, t / 1000, p / 1000) for t, p in SLOS},
            "components_ms": components(records)}


def simulate(layout: tuple[int, int, int, int], model: LatencyModel, requests: list,
             host_cpu_per_token_s: float = 0.0) -> list[RequestRecord]:
    p, d, c, threads = layout
    dep = Deployment(p, d, c, KV_BLOCKS, SchedulerConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=MAX_BATCHED),
                     threads=threads, host_cores=os.cpu_count() or 1, host_cpu_per_token_s=host_cpu_per_token_s)
    reqs = Simulation(dep, model, RouterConfig(model_dir="simulated")).run(requests)
    for r in reqs:
        r.record.timeline = r.timeline
    return [r.record for r in reqs]


def _idle_cpu_share(ps) -> float:
    """The share of a core the process spends over `IDLE_WINDOW_S` with nothing to serve."""
    cpu0, t0 = _cpu_s(ps), time.monotonic()
    time.sleep(IDLE_WINDOW_S)
    return (_cpu_s(ps) - cpu0) / (time.monotonic() - t0)


def _cpu_s(ps) -> float:
    t = ps.cpu_times()
    return t.user + t.system


def _own_cpu_s() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def measure(cfg: str, args: argparse.Namespace, plans: list[list], workdir: Path) \
        -> tuple[list[list[RequestRecord]], LatencyModel, dict[str, float]]:
    """Start the deployment, profile beside it, serve each plan (one per repeat); also the
    CPU ms the router process and this client spent per streamed token while serving. The
    router's own CPU is net of what it spends idle (heartbeats, metrics: the lower of its
    rates over `IDLE_WINDOW_S` before and after serving, times the serving time), which
    lands on whichever core is free rather than on a step."""
    server = start_pdserve(cfg, args.model, workdir, device_flags(cfg, args.device), name=f"pdserve-{cfg}",
                           dtype=args.dtype)
    try:
        model = profile(args.model, LAYOUTS[cfg][3], workdir / f"latency_model_{cfg}.json", args.device, args.dtype)
        load = os.getloadavg()[0]
        idle_rate = _idle_cpu_share(server.ps)
        runs, router_s, client_s, wall_s, tokens = [], 0.0, 0.0, 0.0, 0
        for plan in plans:
            router0, client0, t0 = _cpu_s(server.ps), _own_cpu_s(), time.monotonic()
            records, _ = asyncio.run(run_workload([r for r, _ in plan], "http", server.url, [t for _, t in plan],
                                                  temperature=0.0, ignore_eos=True, return_timeline=True,
                                                  progress=False))
            wall_s += time.monotonic() - t0
            router_s += _cpu_s(server.ps) - router0
            client_s += _own_cpu_s() - client0
            tokens += sum(r.output_len for r in records if r.success)
            runs.append(records)
        tokens = max(1, tokens)
        idle_rate = min(idle_rate, _idle_cpu_share(server.ps))  # a transient in either window only adds
        host = {"router_cpu_ms_per_token": router_s / tokens * 1000,
                "router_idle_cpu_share": idle_rate,
                "router_net_cpu_ms_per_token": max(0.0, router_s - idle_rate * wall_s) / tokens * 1000,
                "client_cpu_ms_per_token": client_s / tokens * 1000}
        log(f"{cfg}: served {len(plans)} x {len(plans[0])} requests (load average {load:.1f} -> "
            f"{os.getloadavg()[0]:.1f}); CPU a token: router {host['router_cpu_ms_per_token']:.2f} ms "
            f"(net of idle {host['router_net_cpu_ms_per_token']:.2f}), client {host['client_cpu_ms_per_token']:.2f} ms")
        if args.bracket:
            after = profile(args.model, LAYOUTS[cfg][3], workdir / f"latency_model_{cfg}_after.json", args.device,
                            args.dtype)
            model = mean_model(model, after)
    finally:
        server.stop()
    return runs, model, host


def device_flags(cfg: str, device: str) -> list[str]:
    """Every worker of the layout on `device` (nothing for the CPU, the servers' default)."""
    if device == "cpu":
        return []
    p, d, c, _ = LAYOUTS[cfg]
    flags = [("--prefill-devices", p), ("--decode-devices", d), ("--colocated-devices", c)]
    return [a for flag, n in flags if n for a in (flag, ",".join([device] * n))]


def _ratio(sim: dict, meas: dict) -> dict:
    return {k: {p: (sim[k][p] / meas[k][p] if sim[k][p] and meas[k][p] else None) for p in ("p50", "p90")}
            for k in ("ttft_ms", "tpot_ms")}


def over_tpot_slo(fig: dict, other: dict) -> dict[str, dict[str, int]]:
    """Per TPOT SLO, the requests over it in `fig`, in `other` and in both (by position:
    the same request in either run). Where the TPOTs are bimodal -- most requests ~one
    step, a few stalled behind a long prompt -- a p90 sits on the knee between the two
    and moves 2x when a few requests change sides; which requests stalled does not."""
    def over(f: dict, ms: float) -> set[int]:
        return {i for i, t in enumerate(f["per_request"]["tpot_s"]) if t is not None and t * 1000 > ms}
    out = {}
    for _, tpot_ms in SLOS:
        a, b = over(fig, tpot_ms), over(other, tpot_ms)
        out[f"tpot{tpot_ms:g}"] = {"this": len(a), "measured": len(b), "both": len(a & b)}
    return out


def add_simulated(dep: dict, cfg: str, requests: list) -> None:
    """The deployment's simulated figures (with and without the host's CPU) and their
    ratios to the measured ones, from its latency model and CPU figures in `dep`."""
    model, host = LatencyModel.from_json(dep["latency_model"]), dep["host_cpu"]
    router_ms = host.get("router_net_cpu_ms_per_token", host["router_cpu_ms_per_token"])  # older files: raw
    host_s = (router_ms + host["client_cpu_ms_per_token"]) / 1000
    sim = figures(simulate(LAYOUTS[cfg], model, requests))
    sim_host = figures(simulate(LAYOUTS[cfg], model, requests, host_s))
    meas = dep["measured"]
    dep.update(simulated=sim, simulated_host_cpu=sim_host, simulated_over_measured=_ratio(sim, meas),
               simulated_host_cpu_over_measured=_ratio(sim_host, meas))
    dep["over_tpot_slo"] = {"simulated": over_tpot_slo(sim, meas), "simulated_host_cpu": over_tpot_slo(sim_host, meas),
                            "repeats": [over_tpot_slo(f, meas) for f in dep.get("repeats", [])]}
    for k in ("simulated_over_measured", "simulated_host_cpu_over_measured", "repeat_over_measured", "over_tpot_slo"):
        if k in dep:
            log(f"{cfg}: {k} {json.dumps(dep[k])}")


def resimulate(a: argparse.Namespace, requests: list) -> int:
    """Simulate the runs stored in --resimulate's files again with this checkout's
    simulator (a later file's deployment replaces an earlier one's); writes --out."""
    out: dict | None = None
    for path in a.resimulate.split(","):
        stored = json.loads(Path(path).read_text())
        if out is None:
            out = dict(stored, resimulated=time.strftime("%Y-%m-%d %H:%M:%S"), sources=a.resimulate.split(","))
        elif {k: stored["config"][k] for k in PLAN_KEYS} != {k: out["config"][k] for k in PLAN_KEYS}:
            sys.exit(f"{path}: another workload than {a.resimulate.split(',')[0]}'s")
        for cfg, dep in stored["deployments"].items():
            add_simulated(dep, cfg, requests)
            out["deployments"][cfg] = dep
    write_report(out, a.out)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    ap.add_argument("--configs", default="colocated,1p1d,2p1d")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--rate", type=float, default=0.5)
    ap.add_argument("--trace-start", type=int, default=0)
    ap.add_argument("--max-input", type=int, default=900)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="serve the load this many times on each deployment "
                    "(token values from seed, seed+1, ...): the later runs against the first are the noise floor")
    ap.add_argument("--no-bracket", dest="bracket", action="store_false", help="profile before the run only")
    ap.add_argument("--device", default="cpu", help="where every worker runs and the profile is taken "
                    "(cuda:0: all on one GPU, which the simulator does not model as shared)")
    ap.add_argument("--dtype", default="float32", help="the workers' and the profile's --dtype (auto: the "
                    "checkpoint's; the default SmolLM2 then keeps its Q4_1 linears)")
    ap.add_argument("--trace", default=str(TRACE), help="the Mooncake conversation trace")
    ap.add_argument("--out", default=str(REPO / "results/simulate_validate.json"))
    ap.add_argument("--resimulate", default="", help="FILE[,FILE]: serve nothing; simulate the runs these "
                    "earlier --out files hold again with this checkout's simulator (their workload's flags are "
                    "read from the first)")
    a = ap.parse_args()
    if a.resimulate:  # the stored run's workload, not this command line's
        stored = json.loads(Path(a.resimulate.split(",")[0]).read_text())["config"]
        a = argparse.Namespace(**dict(vars(a), **{k: stored[k] for k in PLAN_KEYS}, repeats=1))
    vocab = ModelConfig.from_dir(a.model).vocab_size
    # repeats: the same lengths, sharing and send times, other token values (no prefix hits across repeats)
    plans = [workload(argparse.Namespace(**dict(vars(a), seed=a.seed + k)), vocab, Path(a.trace))
             for k in range(a.repeats)]
    requests = [(t, r.prompt_token_ids, r.output_len) for r, t in plans[0]]
    out: dict = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": vars(a), "cores": os.cpu_count(),
                 "slos_ms": SLOS, "deployments": {}}
    if a.resimulate:
        return resimulate(a, requests)
    with tempfile.TemporaryDirectory(prefix="simvalidate-") as tmp:
        for cfg in [c for c in a.configs.split(",") if c]:
            load = os.getloadavg()
            runs, model, host = measure(cfg, a, plans, Path(tmp))
            meas = figures(runs[0])
            dep = out["deployments"][cfg] = {"load_average_1_5_15": load, "latency_model": model.to_json(),
                                              "host_cpu": host, "measured": meas}
            if len(runs) > 1:  # the noise floor: how far the same load served again lands from the first run
                dep["repeats"] = [figures(r) for r in runs[1:]]
                dep["repeat_over_measured"] = [_ratio(f, meas) for f in dep["repeats"]]
            add_simulated(dep, cfg, requests)
    write_report(out, a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
