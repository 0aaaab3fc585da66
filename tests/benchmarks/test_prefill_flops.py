"""benchmarks/offline/prefill_flops.py on a tiny model at tiny sizes: its FLOP count of a prefill
against one made by hand from the model's config, and a whole run's report."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.bench_scripts import script

pf = script("offline.prefill_flops")


def hand_count(cfg: dict, tokens: int) -> float:
    """A prefill's FLOPs from config.json's numbers (see the script's docstring)."""
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * d + heads * d * hidden + 3 * hidden * inter
    attention = 4 * layers * heads * d * tokens * (tokens + 1) / 2
    return 2 * per_layer * layers * tokens + 2 * hidden * cfg["vocab_size"] + attention


def test_prefill_flops_counts_linears_lm_head_once_and_causal_attention(model_dirs):
    llm = pf.make_llm(model_dirs["qwen3"], "float32", 1, 32)
    cfg = json.loads((Path(model_dirs["qwen3"]) / "config.json").read_text())
    for tokens in (1, 17, 32):
        assert pf.prefill_flops(llm.engine.runner.model, tokens) == hand_count(cfg, tokens)


def test_torch_size_halves_until_one_product_fits_the_budget():
    assert pf.torch_size(torch.float32, 4096, budget_s=1e-9) == pf.TORCH_PROBE
    assert pf.torch_size(torch.float32, 1024, budget_s=1e9) == 1024


@pytest.mark.parametrize("dtypes", ["float32,bfloat16,float32+int8"])
def test_a_run_reports_each_dtype_against_both_peaks(model_dirs, tmp_path, dtypes):
    out = tmp_path / "prefill.json"
    assert pf.main(["--model", model_dirs["qwen3"], "--threads", "1", "--tokens", "16,32", "--rounds", "1",
                    "--dtype", dtypes, "--gemm-size", "64", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["host"]["cpu"]["simd"] is not None
    assert set(report["by_dtype"]) == set(dtypes.split(","))
    for entry in report["by_dtype"].values():
        gemm = entry["gemm"]
        assert gemm["peak_gflops"] == max(gemm["torch_gflops"], gemm["pdserve_gflops"]) > 0
        for row in entry["prefill"].values():
            assert row["gflops"] == pytest.approx(row["gflop"] / row["median_s"])
            assert row["share_of_peak"] == pytest.approx(row["gflops"] / gemm["peak_gflops"])
