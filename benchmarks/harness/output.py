"""Writing a benchmark's report: indented JSON (its folder made) and PNG plots (Agg)."""
from __future__ import annotations

import json
from pathlib import Path


def write_report(report: dict, out: str | Path) -> Path:
    """`report` as indented JSON at `out` (its folder made), announced on stdout."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str))
    print(f"wrote {path}")
    return path


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def save_figure(fig, out: str | Path) -> Path:
    """Save and close `fig` at `out` (its folder made)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    pyplot().close(fig)
    print(f"wrote {path}")
    return path
