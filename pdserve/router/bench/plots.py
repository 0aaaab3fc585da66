"""PNG plots: SLO attainment vs rate for several runs, latency CDFs, and a Gantt-style
per-request timeline. matplotlib with the Agg backend (no display needed)."""
from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from pdserve.router.stats.latency import PHASES  # noqa: E402

_COLORS = {"prefill_queue": "#c7c7c7", "prefill": "#1f77b4", "kv_transfer": "#ff7f0e",
           "decode_queue": "#9edae5", "decode": "#2ca02c"}


def _knee_label(res: dict) -> str:
    knee = res.get("goodput_knee") or {}
    if knee.get("rate") is None:
        return "no knee"
    if knee.get("censored") == "above":
        return f"knee >= {knee['rate']:.2f} req/s, censored"
    if knee.get("censored") == "below":
        return f"knee < {knee['rate']:.2f} req/s, censored"
    return f"knee {knee['rate']:.2f} req/s"


def plot_attainment(results: list[dict], labels: list[str], out: str | Path, target: float = 0.9) -> Path:
    """One line per sweep result (as written by `pdserve bench --request-rates`), each point
    with its 95% interval as an error bar; the legend gives the knee, marked when censored."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for res, label in zip(results, labels):
        pts = sorted(res["sweep"], key=lambda p: p["request_rate"])
        rates = [p["request_rate"] for p in pts]
        att = np.asarray([p["slo_attainment"] for p in pts]) * 100
        ci = np.asarray([p.get("slo_attainment_ci95") or [p["slo_attainment"]] * 2 for p in pts]) * 100
        ax.errorbar(rates, att, yerr=[att - ci[:, 0], ci[:, 1] - att], marker="o", capsize=3,
                    label=f"{label} ({_knee_label(res)})")
    ax.axhline(target * 100, color="gray", linestyle="--", linewidth=1)
    slo = results[0].get("config", {}) if results else {}
    ax.set_title(f"SLO attainment vs request rate, 95% intervals (TTFT <= {slo.get('slo_ttft_ms')} ms, "
                 f"TPOT <= {slo.get('slo_tpot_ms')} ms)", fontsize=9)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, out)


def plot_latency_vs_rate(results: list[dict], labels: list[str], out: str | Path) -> Path:
    """TTFT and TPOT median and p99 against the request rate, each with its bootstrap 95%
    interval as an error bar."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, metric, name in ((axes[0], "ttft", "TTFT"), (axes[1], "tpot", "TPOT")):
        for res, label in zip(results, labels):
            pts = sorted(res["sweep"], key=lambda p: p["request_rate"])
            rates = [p["request_rate"] for p in pts]
            for stat, style in (("median", "-"), ("p99", "--")):
                key = f"{stat}_{metric}_ms"
                if not all(key in p for p in pts):
                    continue
                v = np.asarray([p[key] for p in pts])
                ci = np.asarray([p.get(f"{key}_ci95") or [p[key]] * 2 for p in pts])
                ax.errorbar(rates, v, yerr=[v - ci[:, 0], ci[:, 1] - v], linestyle=style, marker="o", capsize=3,
                            label=f"{label} {stat}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name}, 95% bootstrap intervals", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return _save(fig, out)


def plot_latency_cdf(result: dict, out: str | Path) -> Path:
    """CDFs of TTFT and TPOT from a result written with per-request details."""
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.5))
    for ax, key, name in ((axes[0], "ttfts", "TTFT"), (axes[1], "tpots", "TPOT")):
        vals = np.sort(np.asarray([v for v in result.get(key, []) if v is not None]) * 1000)
        if vals.size:
            ax.plot(vals, np.arange(1, vals.size + 1) / vals.size)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("share of requests")
        ax.grid(alpha=0.3)
        ax.set_title(f"{name} CDF")
    return _save(fig, out)


def plot_timelines(timelines: list[dict], out: str | Path, max_requests: int = 40) -> Path:
    """A Gantt chart: one row per request, one colored bar per server phase."""
    tls = [t for t in timelines if t and "arrival" in t][:max_requests]
    fig, ax = plt.subplots(figsize=(9, 0.22 * max(len(tls), 8) + 1))
    t0 = min((t["arrival"] for t in tls), default=0.0)
    for row, tl in enumerate(tls):
        for name, a, b in PHASES:
            if a in tl and b in tl:
                ax.barh(row, (tl[b] - tl[a]) * 1000, left=(tl[a] - t0) * 1000, color=_COLORS[name],
                        label=name if row == 0 else None)
    ax.set_xlabel("time since first arrival (ms)")
    ax.set_ylabel("request")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _COLORS.values()]
    ax.legend(handles, list(_COLORS), fontsize=7, ncol=5, loc="upper center", bbox_to_anchor=(0.5, 1.12))
    return _save(fig, out)


def _save(fig, out: str | Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text())
