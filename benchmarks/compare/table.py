"""README's comparison table, made from a `python -m benchmarks.compare` JSON and nothing else.

A page marks each table with the JSON it comes from:

    <!-- compare-table docs/results/compare/compare_cpu.json -->
    ...the table...
    <!-- /compare-table -->

    python -m benchmarks.compare.table --write   # rewrite every marked table in README.md
    python -m benchmarks.compare.table --check   # exit 1 if one differs from its JSON

tests/benchmarks/test_compare_table.py fails when README's table and its JSON disagree."""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from benchmarks.harness.paths import REPO

BLOCK = re.compile(r"(<!-- compare-table (\S+) -->\n)(.*?)(<!-- /compare-table -->)", re.S)


def knee_text(knee: dict | None) -> str:
    """`2.37 (1.95-2.80)`: the knee and, in brackets, the knees at its points' interval ends;
    `>= 4` / `< 1` where the sweep does not bracket it; `-` where not judged."""
    if not knee or knee.get("rate") is None:
        return "-"

    def one(k: dict) -> str:
        sign = {"above": ">= ", "below": "< "}.get(k.get("censored") or "", "")
        return f"{sign}{k['rate']:.2f}"

    ends = knee.get("interval_ends")
    lo, hi = (one(ends["from_lower"]), one(ends["from_upper"])) if ends else (one(knee), one(knee))
    return one(knee) + ("" if lo == hi == one(knee) else f" ({lo} to {hi})")


def attainment_text(points: list[dict], regime: str) -> str:
    """Each rate's attainment and its 95% interval, `0.5: 65% (55-74)`, joined by `<br>`."""
    cells = []
    for p in points:
        a = p.get("by_regime", {}).get(regime)
        if a:
            lo, hi = a["slo_attainment_ci95"]
            cells.append(f"{p['request_rate']:g}: {a['slo_attainment']:.0%} ({lo:.0%}-{hi:.0%})")
    return "<br>".join(cells) or "-"


def render(report: dict, source: str) -> str:
    """The table (markdown) of one comparison: per system its dtype, unloaded TTFT / TPOT and its
    knee in each regime."""
    regimes = report["regimes"]
    knees = report.get("knees", {})
    chip = report["host"]["cpu"].get("model", "?")
    simd = ", ".join(report["host"]["cpu"].get("simd", []))
    cols = [f"{name}: TTFT <= {r['ttft_ms']:g} ms, TPOT <= {r['tpot_ms']:g} ms" for name, r in regimes.items()]
    dirty = " with uncommitted changes" if report["code"].get("dirty") else ""
    lines = [f"Source: `{source}` (`{report['command']}`, commit {report['code']['commit']}{dirty}), {chip} ({simd}), "
             f"{report['workload']['num_prompts']} requests a point x {report['workload']['repeats']} pass(es), "
             f"rates {', '.join(f'{r:g}' for r in report['workload']['rates'])} req/s, "
             f"{report['workload']['input_len']} in / {report['workload']['output_len']} out. "
             f"vLLM's best dtype here: {report['dtypes']['vllm_best_for_chip']} ({report['dtypes']['why']}). "
             f"{report.get('shared_machine_note') or ''}",
             "",
             "| system | dtype | unloaded TTFT / TPOT (ms) | " + " | ".join(f"{c}: knee (req/s); attainment by rate (95% CI)"
                                                                    for c in cols) + " |",
             "| --- | --- | --- | " + " | ".join("---" for _ in cols) + " |"]
    for name, system in report["systems"].items():
        u = report["unloaded"].get(name, {})
        pts = report.get("points", {}).get(name, [])
        cells = [f"{knee_text(knees.get(regime, {}).get(name))}; {attainment_text(pts, regime)}"
                 if system.get("regime") in (None, regime) else "n/a" for regime in regimes]
        lines.append(f"| {name} | {system['dtype']} | {u.get('ttft_ms', float('nan')):.1f} / "
                     f"{u.get('tpot_ms', float('nan')):.2f} | " + " | ".join(cells) + " |")
    skipped = report.get("skipped") or []
    lines += ["", "Knee: the highest rate with >= 90% of requests meeting both SLOs there and at every lower rate, "
                  "interpolated; in brackets the same from the points' 95% interval ends; `>=` / `<`: censored "
                  "(the sweep does not bracket it); n/a: a planner is judged under its own regime only."
              + (f" Not measured ({len(skipped)} points, the run's time bound): "
                 + ", ".join(f"{k['system']} at {k['rate']:g}" for k in skipped) + "." if skipped else "")]
    return "\n".join(lines) + "\n"


def update(text: str, root: Path = REPO) -> str:
    """`text` with every marked table made again from its JSON."""
    def one(m: re.Match) -> str:
        source = m.group(2)
        report = json.loads((root / source).read_text())
        return m.group(1) + render(report, source) + m.group(4)
    return BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--page", default=str(REPO / "README.md"))
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", action="store_true")
    g.add_argument("--check", action="store_true")
    args = p.parse_args(argv)
    page = Path(args.page)
    text = page.read_text()
    new = update(text)
    if args.check:
        if new != text:
            print(f"{page}: a comparison table differs from its JSON; run python -m benchmarks.compare.table --write",
                  file=sys.stderr)
            return 1
        return 0
    page.write_text(new)
    print(f"wrote {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
