"""The measured crossover (kernels/crossover.py): the rule over timings, the timing
mechanism on synthetic clocks, the override, the per-process and on-disk caches, and one
real measurement of the bf16 products on this CPU."""
from __future__ import annotations

import json

import pytest
import torch

from pdserve import kernels
from pdserve.kernels import cpu_native, crossover
from pdserve.kernels.crossover import NEVER


@pytest.fixture(scope="module", autouse=True)
def built():
    """The native library, built (or found) under the user's cache before `fresh` moves it."""
    assert cpu_native.library() is not None, "the native kernels did not build (is a C compiler installed?)"


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    """Nothing measured in this process, an empty disk cache of its own (on), no override."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("PDSERVE_CPU_CROSSOVER_CACHE", "1")
    monkeypatch.delenv("PDSERVE_CPU_BF16_DOT_ROWS", raising=False)
    crossover.forget()
    yield
    crossover.forget()


def timings(native: dict[int, float], candidate: dict[int, float], reps: int = 3) -> dict:
    return {m: ([native[m]] * reps, [candidate[m]] * reps) for m in native}


ROWS = (1, 2, 4, 8, 16, 32, 64)


def test_monotone_timings_cross_once():
    """A weight stream (flat up to a few rows) against a product with a fixed cost and a
    cheaper slope: the first count the candidate wins from."""
    native = {m: 100 + 10 * m for m in ROWS}
    candidate = {m: 300 + 2 * m for m in ROWS}  # wins from m > 25
    assert crossover.crossover(timings(native, candidate)) == 32


def test_noisy_timings_take_each_sides_best_and_need_every_larger_count():
    native = {m: 100 + 10 * m for m in ROWS}
    candidate = {m: 300 + 2 * m for m in ROWS}
    noisy = {m: ([n * 3, n, n * 1.5], [c, c * 5, c]) for (m, n), c in zip(native.items(), candidate.values())}
    assert crossover.crossover(noisy) == 32  # outliers (slow calls on either side) read past
    # a win at 8 that a loss at 16 interrupts does not count: the wins from 32 on do
    broken = {**noisy, 8: ([500.0], [100.0]), 16: ([100.0], [500.0])}
    assert crossover.crossover(broken) == 32


def test_never_and_always():
    native = {m: 10.0 * m for m in ROWS}
    assert crossover.crossover(timings(native, {m: 11.0 * m for m in ROWS})) == NEVER
    assert crossover.crossover(timings(native, {m: 9.0 * m for m in ROWS})) == 1
    assert crossover.crossover({}) == NEVER
    # a loss at the largest count measured is never, whatever it won below
    assert crossover.crossover(timings(native, {**{m: 1.0 for m in ROWS}, 64: 1e9})) == NEVER
    assert crossover.crossover({4: ([1.0], [1.0])}) == NEVER  # a tie is no win


class FakeClock:
    """A clock that each product advances by its synthetic cost of m rows."""

    def __init__(self) -> None:
        self.now, self.calls = 0.0, []

    def __call__(self) -> float:
        return self.now

    def product(self, name: str, cost):
        def run(x: torch.Tensor) -> None:
            self.calls.append((name, x.shape[0]))
            self.now += cost(x.shape[0])
        return run


def test_measure_times_both_interleaved_from_the_top_and_stops_at_the_first_loss():
    clock = FakeClock()
    native = clock.product("native", lambda m: 100 + 10 * m)
    candidate = clock.product("bf16", lambda m: 300 + 2 * m)
    got = crossover.measure(native, candidate, k=8, rows=ROWS, reps=3, clock=clock)
    assert list(got) == [64, 32, 16]  # 16 lost: nothing below it is timed
    assert got[64] == ([740.0] * 3, [428.0] * 3)
    assert crossover.crossover(got) == 32
    # each count: one untimed call each, then rounds in alternating order
    assert clock.calls[:8] == [("native", 64), ("bf16", 64), ("native", 64), ("bf16", 64), ("bf16", 64),
                               ("native", 64), ("native", 64), ("bf16", 64)]
    assert len(clock.calls) == 3 * 8


def plan_products(calls: list):
    clock = FakeClock()
    native = clock.product("native", lambda m: 100 + 10 * m)
    candidate = clock.product("bf16", lambda m: 300 + 2 * m)

    def counted(fn):
        def run(x):
            calls.append(x.shape[0])
            return fn(x)
        return run

    return clock, counted(native), counted(candidate)


def test_rows_for_measures_once_per_shape_and_keeps_it_on_disk(monkeypatch, tmp_path):
    calls: list[int] = []
    clock, native, candidate = plan_products(calls)
    assert crossover.rows_for("bf16", 96, 8, native, candidate, clock) == 32
    timed = len(calls)
    assert timed > 0
    assert crossover.rows_for("bf16", 96, 8, native, candidate, clock) == 32  # this process's table
    assert len(calls) == timed
    files = list((tmp_path / "crossover").glob("*.json"))
    assert len(files) == 1
    on_disk = json.loads(files[0].read_text())
    assert on_disk["rows"] == {"bf16 96x8": 32} and on_disk["threads"] == torch.get_num_threads()
    crossover.forget()  # a new process on the same machine: read from disk, nothing timed
    assert crossover.rows_for("bf16", 96, 8, native, candidate, clock) == 32
    assert len(calls) == timed
    crossover.rows_for("bf16", 96, 16, native, candidate, clock)  # another shape: measured
    assert len(calls) > timed
    assert json.loads(files[0].read_text())["rows"].keys() == {"bf16 96x8", "bf16 96x16"}


def test_the_disk_cache_is_per_thread_count_and_off_by_default(monkeypatch, tmp_path):
    calls: list[int] = []
    clock, native, candidate = plan_products(calls)
    old = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            crossover.rows_for("bf16", 96, 8, native, candidate, clock)
    finally:
        torch.set_num_threads(old)
    assert len(list((tmp_path / "crossover").glob("*.json"))) == 2
    monkeypatch.delenv("PDSERVE_CPU_CROSSOVER_CACHE")
    crossover.forget()
    before = len(calls)
    crossover.rows_for("bf16", 96, 8, native, candidate, clock)
    crossover.rows_for("bf16", 96, 32, native, candidate, clock)
    assert len(calls) > before  # not read from disk
    assert all("96x32" not in f.read_text() for f in (tmp_path / "crossover").glob("*.json"))  # nor written
    # a malformed file is measured over, not trusted
    monkeypatch.setenv("PDSERVE_CPU_CROSSOVER_CACHE", "1")
    for f in (tmp_path / "crossover").glob("*.json"):
        f.write_text('{"rows": {"bf16 96x8": "many"}}')
    crossover.forget()
    before = len(calls)
    assert crossover.rows_for("bf16", 96, 8, native, candidate, clock) == 32
    assert len(calls) > before


def test_override_fixes_every_shape_without_measuring(monkeypatch):
    def boom(x):
        raise AssertionError("measured under an override")

    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT_ROWS", "5")
    assert crossover.rows_for("bf16", 96, 8, boom, boom) == 5
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT_ROWS", "never")
    assert crossover.rows_for("bf16", 96, 8, boom, boom) == NEVER
    for bad in ("0", "-3", "lots", "2.5"):
        monkeypatch.setenv("PDSERVE_CPU_BF16_DOT_ROWS", bad)
        with pytest.raises(ValueError, match="PDSERVE_CPU_BF16_DOT_ROWS"):
            crossover.rows_for("bf16", 96, 8, boom, boom)


def test_a_bf16_plan_measures_its_shape_on_this_cpu(monkeypatch):
    """The real products, forced on (oneDNN's bf16 runs on any x86-64 CPU; without bf16
    hardware it is slow, so it rarely wins here): the plan's crossover is the rule applied
    to what `measure` timed for its shape, and is kept for the next plan of that shape."""
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "1")
    seen = []
    real = crossover.measure
    monkeypatch.setattr(crossover, "measure", lambda *a, **kw: seen.append(real(*a, **kw)) or seen[-1])
    w = torch.randn(64, 96).to(torch.bfloat16)
    plan = kernels.LinearPlan(w)
    assert len(seen) == 1 and plan.bf16_rows == crossover.crossover(seen[0])
    assert max(seen[0]) == max(crossover.ROWS)
    assert kernels.LinearPlan(w.clone()).bf16_rows == plan.bf16_rows and len(seen) == 1
