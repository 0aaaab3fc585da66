"""The index of committed results, docs/results/index.json: per JSON file under docs/results/
its group, the command that wrote it, the commit and machine it ran on (where the file says;
older reports do not all say), its date, and the pages of the repository that cite it.

    python -m benchmarks.harness.results_index          # rewrite docs/results/index.json
    python -m benchmarks.harness.results_index --check  # exit 1 if it is not current

tests/benchmarks/test_results_index.py fails when the index is not current."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from benchmarks.harness.paths import DOCS_RESULTS, REPO

INDEX = DOCS_RESULTS / "index.json"
PAGES = ("README.md", "docs/*.md")  # where results are cited


def _first(d: dict, *paths: str):
    """The first of the dotted `paths` that `d` has, else None."""
    for path in paths:
        v = d
        for key in path.split("."):
            if not isinstance(v, dict) or key not in v:
                v = None
                break
            v = v[key]
        if v not in (None, "", {}):
            return v
    return None


def facts_of(report: dict) -> dict:
    """What a report says of its own run (None where it does not)."""
    if not isinstance(report, dict):
        return {"command": None, "commit": None, "machine": None, "date": None}
    machine = _first(report, "host.cpu.model", "facts.host.cpu.model", "machine.cpu", "device", "chip")
    if machine is None and isinstance(report.get("machine"), str):
        machine = report["machine"]
    return {"command": _first(report, "command", "facts.command", "config.command"),
            "commit": _first(report, "code.commit", "facts.code.commit", "pdserve_commit", "commit"),
            "machine": machine if isinstance(machine, str) else None,
            "date": _first(report, "date", "facts.date", "started", "meta.date")}


def citing_pages(rel: str, root: Path = REPO) -> list[str]:
    """The pages (README.md, docs/*.md) whose text names `rel` (docs/results/...)."""
    out = []
    for pattern in PAGES:
        for page in sorted(root.glob(pattern)):
            if rel in page.read_text():
                out.append(str(page.relative_to(root)))
    return out


def build(root: Path = REPO) -> dict:
    results = root / "docs" / "results"
    entries = []
    for path in sorted(results.rglob("*.json")):
        if path == results / "index.json":
            continue
        rel = str(path.relative_to(root))
        try:
            report = json.loads(path.read_text())
        except json.JSONDecodeError:
            report = None
        entries.append({"file": rel, "group": path.relative_to(results).parts[0], **facts_of(report),
                        "cited_by": citing_pages(rel, root)})
    return {"about": "every result JSON under docs/results; written by python -m benchmarks.harness.results_index",
            "files": entries}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="exit 1 if docs/results/index.json is not current")
    args = p.parse_args(argv)
    index = build()
    text = json.dumps(index, indent=1) + "\n"
    if args.check:
        current = INDEX.read_text() if INDEX.exists() else ""
        if current != text:
            print(f"{INDEX} is not current: run python -m benchmarks.harness.results_index", file=sys.stderr)
            return 1
        return 0
    INDEX.write_text(text)
    print(f"wrote {INDEX} ({len(index['files'])} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
