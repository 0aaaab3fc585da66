"""Figures in the docs name the JSON they come from, and that JSON exists: in README's "How
fast" every bullet or paragraph that bears a figure cites a docs/results/ JSON; every
docs/results/ path that README.md, docs/benchmarks.md or docs/slo.md cites exists; and each
comparison table in README is the one its JSON makes (benchmarks/compare/table.py)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.bench_scripts import script

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/benchmarks.md", "docs/slo.md")
CITED = re.compile(r"docs/results/[\w./-]+?\.jsonl?\b")
# a measured figure: a number with a unit of time, rate, speed, size or ratio
FIGURE = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:ms|s\b|req/s|tok/s|GB/s|MB|x\b|%)")


def section(text: str, title: str) -> str:
    start = text.index(f"## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else None]


def blocks(text: str) -> list[str]:
    """Bullets and paragraphs (a bullet's continuation lines belong to it); code blocks and
    the generated table's own block are left out (the table test covers the table)."""
    text = re.sub(r"<!-- compare-table .*?<!-- /compare-table -->", "", text, flags=re.S)
    out: list[str] = []
    for para in re.split(r"\n\s*\n", text):
        if para.startswith("    ") or para.startswith("#"):
            continue
        for item in re.split(r"\n(?=- )", para):
            out.append(item)
    return out


def test_every_figure_in_how_fast_names_its_json():
    how_fast = section((ROOT / "README.md").read_text(), "How fast")
    missing = [b for b in blocks(how_fast) if FIGURE.search(b) and not CITED.search(b)]
    assert not missing, "README 'How fast': figures without the docs/results JSON they come from:\n" + "\n---\n".join(missing)


@pytest.mark.parametrize("page", PAGES)
def test_every_cited_result_exists(page):
    cited = set(CITED.findall((ROOT / page).read_text()))
    absent = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not absent, f"{page} cites results that do not exist: {absent}"


def test_readme_comparison_tables_match_their_json():
    text = (ROOT / "README.md").read_text()
    table = script("compare.table")
    assert table.BLOCK.search(text), "README has no generated comparison table"
    assert table.update(text) == text, "README's comparison table differs from its JSON: " \
                                       "python -m benchmarks.compare.table --write"


def test_the_figure_rule_catches_an_uncited_figure():
    text = "## How fast\n\n- offline 1.28x vLLM on a Zen 4\n- served: see docs/results/x/y.json, 3.1 ms\n"
    found = [b for b in blocks(section(text, "How fast")) if FIGURE.search(b) and not CITED.search(b)]
    assert found == ["- offline 1.28x vLLM on a Zen 4"]


@pytest.mark.parametrize("page", ("docs/benchmarks.md", "docs/slo.md"))
def test_reference_pages_stay_reference_sized(page):
    assert len((ROOT / page).read_text().splitlines()) <= 300, f"{page}: over 300 lines; a reference, not a run log"
