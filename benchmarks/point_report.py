"""What benchmarks/vs_vllm.py reports of each serving point: one line per measured point in
the log, a rate's repeats folded into one point of per-metric medians, and, with `--baseline`,
this checkout's medians over the baseline checkout's and over vLLM's. A baseline server's name
is its config's with BASELINE_SUFFIX."""
from __future__ import annotations

import statistics

from servers import log

BASELINE_SUFFIX = "@baseline"


def log_point(name: str, res: dict, num_prompts: int) -> None:
    """One line in the log for a measured point: its figures, or its error."""
    if "error" in res:
        log(f"  {name}: {res['error']}")
        return
    log(f"  {name:<18} done {res['completed']}/{num_prompts}  attain {res['slo_attainment']:4.0%}  "
        f"TTFT mean {res['mean_ttft_ms']:7.0f} p99 {res['p99_ttft_ms']:7.0f} ms  TPOT mean "
        f"{res['mean_tpot_ms']:6.1f} p99 {res['p99_tpot_ms']:6.1f} ms  goodput {res['request_goodput']:.2f} "
        f"req/s  out {res['output_throughput']:.1f} tok/s  other cpu {res['other_cpu_s']} s"
        + (f"  idle others cpu {res['idle_others_cpu_s']}" if res["idle_others_cpu_s"] else ""))


MEDIAN_KEYS = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms", "slo_attainment", "request_goodput",
               "output_throughput")


def median_point(rate: float, pts: list[dict]) -> dict:
    """Per metric, the median over a rate's repeats (each repeat: fresh prompts and arrivals)."""
    ok = [p for p in pts if "error" not in p]
    if not ok:
        return {"request_rate": rate, "error": pts[0]["error"] if pts else "no points"}
    cpu = [p["top_cpu_ms_per_1k_tokens"] for p in ok if p.get("top_cpu_ms_per_1k_tokens")]
    return {"request_rate": rate, "repeats": len(ok),
            **{k: statistics.median(p[k] for p in ok) for k in MEDIAN_KEYS},
            "top_cpu_ms_per_1k_tokens": statistics.median(cpu) if cpu else None}


def baseline_ratios(serving: dict) -> dict:
    """Per config and rate: this checkout's median figures over the baseline checkout's
    (`--baseline`), and each one's over vLLM's where vLLM ran. Below 1 is faster."""
    out: dict = {}
    keys = ("mean_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p99_tpot_ms")
    for name, r in serving.items():
        base = serving.get(name + BASELINE_SUFFIX)
        if name.startswith("_") or name.endswith(BASELINE_SUFFIX) or base is None:
            continue
        vllm = {p["request_rate"]: p for p in serving.get("vllm", {}).get("sweep", []) if "error" not in p}
        rows = []
        for ours, theirs in zip(r["sweep"], base["sweep"]):
            if "error" in ours or "error" in theirs:
                continue
            row = {"request_rate": ours["request_rate"], **{f"{k}_over_baseline": ours[k] / theirs[k] for k in keys}}
            if ours.get("top_cpu_ms_per_1k_tokens") and theirs.get("top_cpu_ms_per_1k_tokens"):
                row["top_cpu_ms_per_1k_tokens_over_baseline"] = \
                    ours["top_cpu_ms_per_1k_tokens"] / theirs["top_cpu_ms_per_1k_tokens"]
            v = vllm.get(ours["request_rate"])
            if v is not None:
                row.update({f"{k}_over_vllm": ours[k] / v[k] for k in keys},
                           **{f"baseline_{k}_over_vllm": theirs[k] / v[k] for k in keys})
            rows.append(row)
        out[name] = rows
    return out
