"""benchmarks/vs_vllm.py's figure: SLO attainment, TTFT and TPOT against the request rate
per server (or, with serving skipped, each engine's offline runs)."""
from __future__ import annotations

import statistics
from pathlib import Path


def plot(report: dict, path: Path, slo: tuple[float, float]) -> None:
    """The report's figure at `path`; `slo` (TTFT, TPOT seconds) drawn as lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    off = report.get("offline") or {}
    if not report.get("serving"):
        plot_offline(off, path, plt)
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, r in report.get("serving", {}).items():
        if name == "_crosscheck":
            continue
        pts = sorted((p for p in r["sweep"] if "error" not in p), key=lambda p: p["request_rate"])
        x = [p["request_rate"] for p in pts]
        line = axes[0].plot(x, [p["slo_attainment"] * 100 for p in pts], marker="o", label=name)[0]
        c = line.get_color()
        axes[1].plot(x, [p["mean_ttft_ms"] for p in pts], marker="o", color=c, label=f"{name} mean")
        axes[1].plot(x, [p["p99_ttft_ms"] for p in pts], marker="^", linestyle="--", color=c, label=f"{name} p99")
        axes[2].plot(x, [p["mean_tpot_ms"] for p in pts], marker="o", color=c, label=f"{name} mean")
        axes[2].plot(x, [p["p99_tpot_ms"] for p in pts], marker="^", linestyle="--", color=c, label=f"{name} p99")
    axes[0].axhline(90, color="gray", linestyle=":", linewidth=1)
    axes[0].set(xlabel="request rate (req/s)", ylabel="SLO attainment (%)", ylim=(-5, 105),
                title=f"SLO attainment (TTFT <= {slo[0]:g} s, TPOT <= {slo[1] * 1000:g} ms)")
    axes[1].axhline(slo[0] * 1000, color="gray", linestyle=":", linewidth=1)
    axes[1].set(xlabel="request rate (req/s)", ylabel="TTFT (ms)", yscale="log", title="TTFT")
    axes[2].axhline(slo[1] * 1000, color="gray", linestyle=":", linewidth=1)
    axes[2].set(xlabel="request rate (req/s)", ylabel="TPOT (ms)", title="TPOT")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    parts = [f"{e} {off[e]['tokens_per_s']:.1f} tok/s" for e in ("pdserve", "vllm") if off.get(e)]
    fig.suptitle(f"pdserve vs vLLM (CPU, 2 cores, small qwen3 fp32); offline: {', '.join(parts) or 'not run'}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_offline(off: dict, path: Path, plt) -> None:
    """Serving skipped: each engine's offline runs in the order they ran, and their medians."""
    fig, ax = plt.subplots(figsize=(7, 4.2))
    runs = off.get("runs") or {}
    for engine in ("pdserve", "vllm"):
        tps = [r["tokens_per_s"] for r in runs.get(engine, [])]
        if tps:
            ax.plot(range(1, len(tps) + 1), tps, marker="o", label=f"{engine} (median {statistics.median(tps):.1f})")
    ratio = off.get("ratio_pdserve_over_vllm")
    ax.set(xlabel="run", ylabel="output tokens / s", ylim=(0, None),
           title=f"offline throughput, median ratio {ratio:.2f}x" if ratio else "offline throughput")
    ax.set_xticks(range(1, 1 + max((len(v) for v in runs.values()), default=0)))
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
