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


def plot_attainment(results: list[dict], labels: list[str], out: str | Path, target: float = 0.9) -> Path:
    """One line per sweep result (as written by `pdserve bench --request-rates`)."""
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for res, label in zip(results, labels):
        pts = sorted((p["request_rate"], p["slo_attainment"]) for p in res["sweep"])
        gr = res.get("goodput_rate")
        ax.plot([r for r, _ in pts], [a * 100 for _, a in pts], marker="o",
                label=f"{label} (goodput rate {gr:.2f} req/s)" if gr else f"{label} (below target at all rates)")
    ax.axhline(target * 100, color="gray", linestyle="--", linewidth=1)
    slo = results[0].get("config", {}) if results else {}
    ax.set_title(f"SLO attainment vs request rate (TTFT <= {slo.get('slo_ttft_ms')} ms, TPOT <= {slo.get('slo_tpot_ms')} ms)",
                 fontsize=9)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("SLO attainment (%)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
