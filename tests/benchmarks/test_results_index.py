"""docs/results/index.json is current: it lists every result JSON under docs/results with
the pages that cite it, as `python -m benchmarks.harness.results_index` writes it; and no
result JSON lies loose in docs/."""
from __future__ import annotations

import json
from pathlib import Path

from tests.support.bench_scripts import script

ROOT = Path(__file__).resolve().parents[2]
index = script("harness.results_index")


def test_the_index_is_current():
    assert json.loads(index.INDEX.read_text()) == index.build(), \
        "docs/results/index.json is stale: run python -m benchmarks.harness.results_index"


def test_every_result_lies_under_docs_results():
    assert not list((ROOT / "docs").glob("*.json")), "result JSON files belong under docs/results/<group>/"


def test_facts_are_read_from_a_report_that_says_them():
    report = {"date": "d", "command": "python -m benchmarks.compare", "code": {"commit": "abc"},
              "host": {"cpu": {"model": "AMD EPYC"}}}
    assert index.facts_of(report) == {"command": "python -m benchmarks.compare", "commit": "abc",
                                      "machine": "AMD EPYC", "date": "d"}
    assert index.facts_of({"machine": {"cores": 2}}) == {"command": None, "commit": None, "machine": None, "date": None}
