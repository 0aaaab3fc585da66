"""The shifting-mix trace (router/bench/shifting_trace.py): prompt-heavy then decode-heavy,
Mooncake's rows, deterministic by seed, read back by bench's Mooncake loader."""
from __future__ import annotations

import pytest

from pdserve.router.bench.shifting_trace import Phase, shifting_mix, write_trace
from pdserve.router.bench.workloads import mooncake_workload


def test_halves_have_their_phase_mix():
    first, second = Phase(10_000, 100, 5.0), Phase(1_000, 2_000, 5.0)
    rows = shifting_mix(200.0, seed=3, first=first, second=second, jitter=0.2)
    early = [r for r in rows if r["timestamp"] < 100_000]
    late = [r for r in rows if r["timestamp"] >= 100_000]
    assert 400 < len(early) < 600 and 400 < len(late) < 600  # Poisson, 5/s for 100 s each
    assert all(8_000 <= r["input_length"] <= 12_000 and 80 <= r["output_length"] <= 120 for r in early)
    assert all(800 <= r["input_length"] <= 1_200 and 1_600 <= r["output_length"] <= 2_400 for r in late)
    ts = [r["timestamp"] for r in rows]
    assert ts == sorted(ts) and ts[-1] < 200_000


def test_hash_ids_cover_the_prompt_and_are_never_shared():
    rows = shifting_mix(30.0, seed=1)
    ids = [h for r in rows for h in r["hash_ids"]]
    assert len(ids) == len(set(ids))
    assert all(len(r["hash_ids"]) == -(-r["input_length"] // 512) for r in rows)


def test_deterministic_by_seed():
    assert shifting_mix(20.0, seed=5) == shifting_mix(20.0, seed=5)
    assert shifting_mix(20.0, seed=5) != shifting_mix(20.0, seed=6)


def test_bench_reads_it_as_a_mooncake_trace(tmp_path):
    rows = shifting_mix(20.0, seed=2, first=Phase(3_200, 64, 2.0), second=Phase(640, 320, 2.0), jitter=0.0)
    path = write_trace(tmp_path / "t.jsonl", rows)
    reqs = mooncake_workload(path, len(rows), 32, 1000)
    assert [r.prompt_len for r in reqs] == [r["input_length"] // 32 for r in rows]
    assert [r.output_len for r in reqs] == [r["output_length"] // 32 for r in rows]
    assert reqs[-1].arrival == pytest.approx((rows[-1]["timestamp"] - rows[0]["timestamp"]) / 1000)


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="duration_s"):
        shifting_mix(0.0)
    with pytest.raises(ValueError, match="rates"):
        shifting_mix(10.0, first=Phase(100, 10, 0.0))
