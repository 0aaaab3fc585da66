"""Where the repository, its scratch results and its committed results are."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "results"  # scratch output of runs (git-ignored)
DOCS_RESULTS = REPO / "docs" / "results"  # committed results, one folder per group, indexed in index.json
