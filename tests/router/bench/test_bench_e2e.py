"""`pdserve bench` end to end: a real 1 prefill + 1 decode CPU server (`pdserve serve`, tiny
Qwen3, one torch thread per worker: the package's `pd`), a 2-rate sweep and a single
detailed run as subprocesses; the JSON and the three plots come out, and no process
outlives the server (its teardown checks)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.bench_result_keys import DETAIL_KEYS, SUMMARY_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_PROMPTS = 8


@pytest.fixture(scope="module")
def server(pd) -> dict:
    """The package's 1P+1D server (tests/router/conftest.py): its ready-file info. Its
    teardown stops it and checks that the router and both workers are gone."""
    return pd.info


def _bench(server: dict, model_dir: str, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "pdserve", "bench", "--url", server["zmq"], "--model", model_dir,
           "--num-prompts", str(NUM_PROMPTS), "--input-len", "48", "--output-len", "6", "--warmup", "1",
           "--slo-ttft-ms", "2000", "--slo-tpot-ms", "500", "--no-progress", "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(out.read_text())


def _is_png(path: Path) -> bool:
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == PNG_MAGIC


def test_bench_sweep_and_detailed_run(server, model_dirs, tmp_path):
    plots = tmp_path / "plots"
    sweep = _bench(server, model_dirs["qwen3"], tmp_path / "sweep.json", "--request-rates", "4,16",
                   "--plot-dir", str(plots))
    assert [p["request_rate"] for p in sweep["sweep"]] == [4.0, 16.0]
    for point in sweep["sweep"]:
        assert SUMMARY_KEYS <= set(point)
        assert point["completed"] == NUM_PROMPTS and point["failed"] == 0
        assert point["total_output_tokens"] == NUM_PROMPTS * 6
    # generous SLOs on 8 requests: nothing misses, so the knee is censored at the top rate
    assert sweep["goodput_knee"]["censored"] == "above" and sweep["goodput_knee"]["rate"] == 16.0
    assert sweep["warmup"]["excluded"] and sweep["warmup"]["requests_per_point"] == 1
    assert all(p["slo_attainment_ci95"][0] < 1.0 == p["slo_attainment_ci95"][1] for p in sweep["sweep"])
    assert _is_png(plots / "attainment_vs_rate.png") and _is_png(plots / "latency_vs_rate.png")

    single = _bench(server, model_dirs["qwen3"], tmp_path / "single.json", "--request-rate", "8",
                    "--save-detailed", "--plot-dir", str(plots))
    assert SUMMARY_KEYS | DETAIL_KEYS <= set(single)
    assert single["completed"] == NUM_PROMPTS and single["failed"] == 0
    assert single["output_lens"] == [6] * NUM_PROMPTS and single["input_lens"] == [48] * NUM_PROMPTS
    assert 0 < single["mean_ttft_ms"] <= single["mean_e2el_ms"]
    assert single["mean_tpot_ms"] > 0
    # disaggregated: every request went through prefill, KV transfer and decode on the server
    assert all(tl and {"prefill_start", "prefill_end", "kv_ready", "first_token", "finish"} <= set(tl)
               for tl in single["timelines"])
    assert {"mean_prefill_ms", "mean_kv_transfer_ms", "mean_decode_ms"} <= set(single)
    assert _is_png(plots / "latency_cdf.png") and _is_png(plots / "timelines.png")


def test_bench_http_backend(server, model_dirs, tmp_path):
    """The HTTP backend (the one that also drives vLLM) against pdserve: it asks for usage
    (stream_options) and still counts pdserve's token ids, exactly output-len per request."""
    res = _bench(server, model_dirs["qwen3"], tmp_path / "http.json", "--backend", "http", "--url", server["http"],
                 "--request-rate", "16", "--save-detailed")
    assert res["completed"] == NUM_PROMPTS and res["failed"] == 0
    assert res["output_lens"] == [6] * NUM_PROMPTS
    assert 0 < res["mean_ttft_ms"] <= res["mean_e2el_ms"] and res["mean_tpot_ms"] > 0
