"""The JSON that `pdserve bench` writes (router/cli/bench.py): vLLM `bench serve` key names,
per-request details, sweeps with their goodput rate, and trace replay's reported rate.
The network runner is replaced by one that returns fixed timings and records the send
schedule, so these run without a server."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from pdserve.router.cli import bench as cli
from pdserve.router.stats.intervals import wilson_interval
from pdserve.router.stats.latency import RequestRecord
from tests.support.bench_result_keys import DETAIL_KEYS, SUMMARY_KEYS

TRACE = "/work/shared/data/mooncake/conversation_trace.jsonl"


class FakeRunner:
    """Stands in for runner.run_workload: request i gets TTFT ttft_s(rate, i) and 10 ms
    between its tokens; the send schedule of every call is kept."""

    def __init__(self, ttft_s=lambda rate, i: 0.050):
        self.ttft_s = ttft_s
        self.calls: list[list[float]] = []
        self.prompts: list[list[list[int]]] = []  # each call's measured prompts
        self.warmups: list[list] = []  # each call's warm-up requests

    async def __call__(self, reqs, backend, url, send_times, max_concurrency=None, temperature=0.0, ignore_eos=True,
                       return_timeline=True, warmup=(), progress=True):
        self.calls.append(list(send_times))
        self.prompts.append([r.prompt_token_ids for r in reqs])
        self.warmups.append(list(warmup))
        rate = len(reqs) / send_times[-1] if send_times[-1] > 0 else float("inf")
        records = []
        for i, (r, t) in enumerate(zip(reqs, send_times)):
            first = t + self.ttft_s(rate, i)
            tl = {"arrival": t, "prefill_queued": t, "prefill_start": t, "prefill_end": first - 0.002,
                  "kv_ready": first - 0.001, "first_token": first, "finish": first + 0.01 * (r.output_len - 1)}
            records.append(RequestRecord(t, [first + 0.01 * k for k in range(r.output_len)], r.prompt_len, timeline=tl))
        return records, max(rec.token_times[-1] for rec in records)


def _args(model_dir: str, out: Path, *extra: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(["--url", "tcp://127.0.0.1:1", "--model", model_dir, "--out", str(out), "--no-progress",
                         "--num-prompts", "20", "--input-len", "40", "--output-len", "5", *extra])


@pytest.fixture
def fake(monkeypatch) -> FakeRunner:
    runner = FakeRunner()
    monkeypatch.setattr(cli, "run_workload", runner)
    return runner


def test_single_run_json_has_the_documented_keys(model_dirs, fake, tmp_path):
    out = tmp_path / "r.json"
    assert cli.main(_args(model_dirs["qwen3"], out, "--request-rate", "8", "--slo-ttft-ms", "100",
                          "--slo-tpot-ms", "20", "--save-detailed", "--slo-scales", "0.4,1")) == 0
    res = json.loads(out.read_text())
    assert SUMMARY_KEYS | DETAIL_KEYS | {"date", "backend", "num_prompts", "config"} <= set(res)
    assert res["completed"] == res["num_prompts"] == 20 and res["failed"] == 0
    assert res["total_input_tokens"] == 20 * 40 and res["total_output_tokens"] == 20 * 5
    assert res["mean_ttft_ms"] == pytest.approx(50.0) and res["mean_tpot_ms"] == pytest.approx(10.0)
    assert res["mean_itl_ms"] == pytest.approx(10.0) and res["mean_e2el_ms"] == pytest.approx(90.0)
    assert res["slo_attainment"] == 1.0
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])
    assert res["slo_scale_attainment"] == {"0.4": 0.0, "1": 1.0}  # TTFT 50 ms > 0.4 * 100 ms
    assert res["mean_prefill_ms"] == pytest.approx(48.0) and res["mean_kv_transfer_ms"] == pytest.approx(1.0)
    assert len(res["ttfts"]) == len(res["timelines"]) == 20
    assert res["config"]["slo_ttft_ms"] == 100 and res["config"]["slo_tpot_ms"] == 20
    # the offered schedule: Poisson at the asked rate, seeded
    assert len(fake.calls) == 1 and fake.calls[0][0] == 0.0


def test_sweep_json_carries_every_point_and_the_goodput_knee(model_dirs, tmp_path, monkeypatch):
    # attainment 1.0 at 1 req/s, 0.95 at 2 req/s, 0.5 at 4 req/s: requests past a share miss TTFT
    share = {1: 20, 2: 19, 4: 10}
    runner = FakeRunner(lambda rate, i: 0.050 if i < share[min(share, key=lambda r: abs(r - rate))] else 0.500)
    monkeypatch.setattr(cli, "run_workload", runner)
    out = tmp_path / "sweep.json"
    # burstiness 1000: near-periodic arrivals, so each sweep point's measured rate is close to the asked one
    assert cli.main(_args(model_dirs["qwen3"], out, "--request-rates", "1,2,4", "--burstiness", "1000",
                          "--slo-ttft-ms", "100", "--plot-dir", str(tmp_path / "plots"))) == 0
    res = json.loads(out.read_text())
    assert [p["request_rate"] for p in res["sweep"]] == [1.0, 2.0, 4.0]
    assert [p["slo_attainment"] for p in res["sweep"]] == pytest.approx([1.0, 0.95, 0.5])
    assert all(SUMMARY_KEYS <= set(p) for p in res["sweep"])
    assert [x for p in res["sweep"] for x in p["slo_attainment_ci95"]] == pytest.approx(
        [x for k in (20, 19, 10) for x in wilson_interval(k, 20)])
    expected = 2 + (0.95 - 0.9) * (4 - 2) / (0.95 - 0.5)
    assert res["goodput_knee"]["rate"] == pytest.approx(expected) and res["goodput_knee"]["censored"] is None
    assert (tmp_path / "plots" / "attainment_vs_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_sweep_that_never_misses_reports_a_censored_knee(model_dirs, fake, tmp_path, capsys):
    out = tmp_path / "sweep.json"
    assert cli.main(_args(model_dirs["qwen3"], out, "--request-rates", "1,2", "--burstiness", "1000",
                          "--slo-ttft-ms", "100")) == 0
    res = json.loads(out.read_text())
    assert res["goodput_knee"]["censored"] == "above" and res["goodput_knee"]["rate"] == res["sweep"][-1]["request_rate"]
    printed = capsys.readouterr().out
    assert "goodput knee" in printed and ">= " in printed and "censored" in printed
    assert "95% Wilson (20/20)" in printed


def test_each_point_gets_fresh_prompts_and_a_warmup_of_its_own(model_dirs, fake, tmp_path):
    """No point may find its prompts in the server's prefix cache: not from an earlier point,
    not from the warm-up; the warm-up is said in the JSON and in no figure."""
    out = tmp_path / "sweep.json"
    assert cli.main(_args(model_dirs["qwen3"], out, "--request-rates", "1,2", "--warmup", "3")) == 0
    res = json.loads(out.read_text())
    first, second = (set(map(tuple, ps)) for ps in fake.prompts)
    warm = {tuple(w.prompt_token_ids) for ws in fake.warmups for w in ws}
    assert len(fake.warmups[0]) == len(fake.warmups[1]) == 3
    assert not first & second and not warm & (first | second)
    assert res["warmup"] == {**res["warmup"], "requests_per_point": 3, "excluded": True}
    assert all(p["completed"] == 20 for p in res["sweep"])  # the warm-up is not among them


def test_trace_sweep_rescales_the_trace_clock(model_dirs, fake, tmp_path):
    out = tmp_path / "trace.json"
    assert cli.main(_args(model_dirs["qwen3"], out, "--workload", "mooncake", "--dataset-path", TRACE,
                          "--num-prompts", "60", "--request-rates", "2,8")) == 0
    res = json.loads(out.read_text())
    for point, times in zip(res["sweep"], fake.calls):
        assert len(times) / times[-1] == pytest.approx(point["request_rate"])
    assert fake.calls[1] == pytest.approx([t / 4 for t in fake.calls[0]])  # same trace shape, 4x faster


def test_trace_replay_reports_the_rate_it_offered(model_dirs, fake, tmp_path):
    """A single trace replay sends on the trace's clock (/ --time-scale); the request_rate it
    reports must be the rate it actually offered, whatever --request-rate says."""
    out = tmp_path / "trace.json"
    assert cli.main(_args(model_dirs["qwen3"], out, "--workload", "mooncake", "--dataset-path", TRACE,
                          "--num-prompts", "60", "--time-scale", "2", "--request-rate", "5")) == 0
    res = json.loads(out.read_text())
    times = fake.calls[0]
    assert res["request_rate"] == pytest.approx(len(times) / times[-1])
