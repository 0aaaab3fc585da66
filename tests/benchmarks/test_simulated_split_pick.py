"""benchmarks/slo/simulated_split_pick.py's --validation ranking, without servers: the
simulated pick per SLO pair against each served run's best, a later report's deployment
replacing an earlier one's."""
from __future__ import annotations

import json

import pytest

from tests.support.bench_scripts import script


@pytest.fixture(scope="module")
def ssp():
    yield script("slo.simulated_split_pick")


def dep(sim: float, *served: float) -> dict:
    fig = lambda a: {"attainment": {"slo": a}}  # noqa: E731
    return {"simulated_host_cpu": fig(sim), "measured": fig(served[0]), "repeats": [fig(a) for a in served[1:]]}


def write(tmp_path, name: str, deps: dict) -> str:
    path = tmp_path / name
    path.write_text(json.dumps({"deployments": deps}))
    return str(path)


def test_the_pick_against_each_served_runs_best(ssp, tmp_path):
    first = write(tmp_path, "a.json", {"colocated": dep(0.9, 0.5, 0.5), "1p1d": dep(0.5, 0.8, 0.6)})
    later = write(tmp_path, "b.json", {"colocated": dep(0.7, 0.75, 0.7), "2p1d": dep(0.6, 0.6, 0.72)})
    r = ssp.validation_picks([first, later])["regimes"]["slo"]
    assert r["simulated"] == {"colocated": 0.7, "1p1d": 0.5, "2p1d": 0.6}  # b's colocated replaced a's
    assert r["simulated_pick"] == "colocated"
    assert r["served_best"] == ["1p1d", "2p1d"]
    assert r["pick_over_best"] == pytest.approx([0.75 / 0.8, 0.7 / 0.72])


def test_a_run_where_nothing_is_attained_has_no_ratio(ssp, tmp_path):
    only = write(tmp_path, "c.json", {"colocated": dep(0.2, 0.0), "1p1d": dep(0.1, 0.0)})
    assert ssp.validation_picks([only])["regimes"]["slo"]["pick_over_best"] == [None]
