"""`pdserve bench` end to end: a real 1 prefill + 1 decode CPU server (`pdserve serve`, tiny
Qwen3, one torch thread per worker), a 2-rate sweep and a single detailed run as
subprocesses; the JSON and the three plots come out, and no process outlives the test."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.router.bench.result_keys import DETAIL_KEYS, SUMMARY_KEYS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
NUM_PROMPTS = 8


def _alive(pid: int) -> bool:
    """A live (not zombie) pdserve process (router or worker) with this pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z" and \
        any(m in cmdline for m in ("router.cli", "prefill_node", "decode_node"))


@pytest.fixture(scope="module")
def server(model_dirs, tmp_path_factory):
    """A 1P+1D server; yields its ready-file info. Teardown stops it and checks that the
    router and both workers are gone."""
    work = tmp_path_factory.mktemp("bench_server")
    ready = work / "ready.json"
    log = open(work / "serve.log", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "router.cli", "serve", model_dirs["qwen3"], "--prefill", "1", "--decode", "1",
         "--num-threads", "1", "--http-port", "0", "--zmq-port", "0", "--ready-file", str(ready),
         "--num-kv-blocks", "256", "--max-model-len", "256"],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    pids: list[int] = [proc.pid]
    try:
        deadline = time.monotonic() + 120
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"server not ready (exit code {proc.poll()}):\n{(work / 'serve.log').read_text()[-3000:]}")
            time.sleep(0.1)
        info = json.loads(ready.read_text())
        pids += [w["pid"] for w in info["workers"].values()]
        assert info["pid"] == proc.pid and len(info["workers"]) == 2
        yield info
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            for pid in pids:  # only the processes this fixture started
                if _alive(pid):
                    os.kill(pid, signal.SIGKILL)
            proc.wait(10)
        log.close()
        deadline = time.monotonic() + 10
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in pids if _alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left after SIGTERM: {left}"


def _bench(server: dict, model_dir: str, out: Path, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "router.cli", "bench", "--url", server["zmq"], "--model", model_dir,
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
    assert "goodput_rate" in sweep
    assert _is_png(plots / "attainment_vs_rate.png")

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
