"""benchmarks/decode/parts.py on a tiny model: every decode step times its parts in the
native call, the parts add up to that call, the call fits in the step, and each product
part is set against the bytes its packed matrices hold."""
from __future__ import annotations

import json

import pytest

from tests.support.bench_scripts import script


@pytest.fixture(scope="module")
def decode_parts():
    yield script("decode.parts")


def test_a_run_times_each_part_of_every_decode_step(decode_parts, model_dirs, tmp_path):
    out = tmp_path / "parts.json"
    tokens = 6
    assert decode_parts.main(["--model", model_dirs["qwen3"], "--tokens", str(tokens), "--rounds", "2", "--threads", "1",
                              "--dtype", "float32,float32+int8", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["parts"] == list(decode_parts.PARTS)
    for form in ("float32", "float32+int8"):
        s = report["by_form"][form]
        for r in s["rounds"]:
            assert r["calls"] == tokens - 1  # the first token comes with the prefill, each other one decode step
            assert sum(r["parts_us"].values()) == pytest.approx(r["native_us"], rel=1e-6)
            assert 0 < r["native_us"] < r["step_us"]
        for g in decode_parts.GEMMS:
            row = s["parts"][g]
            assert row["bytes"] > 0 and row["us"] > 0 and row["x_bound"] > 0
        assert s["gemms"]["bytes"] == sum(s["parts"][g]["bytes"] for g in decode_parts.GEMMS)
    # int8 blocks: one byte a weight and a float16 scale per 32, against float32's four bytes
    f32, q8 = (report["by_form"][f]["parts"]["gate_up"]["bytes"] for f in ("float32", "float32+int8"))
    assert q8 == pytest.approx(f32 * (1 + 2 / 32) / 4, rel=1e-6)


def test_a_form_without_the_native_stack_is_refused(decode_parts, model_dirs, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")  # the native kernels off: no stack
    with pytest.raises(SystemExit):
        decode_parts.main(["--model", model_dirs["qwen3"], "--tokens", "4", "--rounds", "1", "--threads", "1",
                           "--dtype", "float32", "--out", str(tmp_path / "x.json")])
    assert "do not run the native stack" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()
