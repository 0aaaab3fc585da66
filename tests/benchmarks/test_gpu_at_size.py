"""benchmarks/gpu/at_size.py through its CPU stand-in (`--device cpu --size tiny`, smaller
still): every section runs and the JSON has each figure beside its limit -- decode steps
beside the weights(+KV)-over-bandwidth bound, the prefill beside the matmul peak, the
mixed prefill with and without cached prefixes, the prefill kernel against the SDPA loop,
float32 greedy tokens against transformers, pdserve's and transformers' decode steps, and the
targets computed from them."""
from __future__ import annotations

import json

import torch

from benchmarks.gpu import at_size, exactness


def test_cpu_stand_in_writes_every_figure_beside_its_limit(tmp_path):
    out = tmp_path / "at_size.json"
    rc = at_size.main(["--device", "cpu", "--size", "tiny", "--batches", "1,2", "--contexts", "16,40", "--steps", "2",
                       "--mixed", "16,40", "--anchor-batches", "1,16", "--anchor-prompt", "8", "--anchor-tokens", "4",
                       "--read-bytes", str(8 << 20), "--matmul-size", "128", "--no-exactness", "--out", str(out)])
    report = json.loads(out.read_text())
    assert rc == 0, {k: v.get("error") for k, v in report.items() if isinstance(v, dict) and "error" in v}
    assert report["model"]["parameters"] > 0 and report["env"]["device"] == "cpu"
    limits = report["limits"]
    assert limits["read"]["read_gb_per_s"] > 0 and limits["matmul"]["tflops"] > 0

    rows = report["decode"]["rows"]
    assert {(r["batch"], r["context"]) for r in rows} == {(1, 16), (2, 16), (1, 40), (2, 40)}
    for r in rows:
        assert r["step_ms"] > 0 and 0 < r["weights_bound_ms"] < r["bound_ms"]  # the KV adds to the weights
        assert r["vs_bound"] == r["step_ms"] / r["bound_ms"]
    assert rows[1]["kv_bytes"] == 2 * rows[0]["kv_bytes"]  # batch 2 reads twice batch 1's KV
    kernel = report["decode"]["attention_kernel"]
    assert (kernel["batch"], kernel["context"]) == (2, 16) and kernel["max_abs_diff"] < 1e-4
    assert kernel["kv_gb_per_s"] > 0 and kernel["vs_read_bandwidth"] > 0

    pre = report["prefill"]
    one = pre["one_prompt"]
    assert one["tflops"] > 0 and one["share_of_matmul_peak"] == one["tflops"] / limits["matmul"]["tflops"]
    fresh, cached = pre["mixed_fresh"], pre["mixed_cached_prefixes"]
    assert fresh["cached_tokens"] == 0 and cached["cached_tokens"] == 16  # half of the 40-token prompt, whole blocks
    assert cached["computed_tokens"] == fresh["computed_tokens"] - 16
    assert pre["cached_vs_fresh_us_per_token"] > 0
    ab = pre["attention_kernel_vs_sdpa_loop"]
    assert ab["kernel"] == "cpu_native" and ab["kernel_ms"] > 0 and ab["sdpa_loop_ms"] > 0 and ab["max_abs_diff"] < 1e-4

    ours = report["anchor_pdserve"]["rows"]
    theirs = report["anchor_transformers"]["rows"]
    assert [r["batch"] for r in ours] == [1, 16] and [(r["batch"], r["compiled"]) for r in theirs] == [(1, False), (16, False)]
    assert all(r["ms_per_step_median"] > 0 and r["decode_steps"] == 3 for r in ours + theirs)

    assert "exactness" not in report  # --no-exactness (below on its own)

    targets = report["targets"]
    assert set(targets) == set(at_size.TARGETS) - {"decode_batch64_ctx1k_vs_weights_kv_bound"}  # no batch 64 here
    for name, t in targets.items():
        assert t["value"] > 0 and t["bound"] == " ".join(map(str, at_size.TARGETS[name]))
        assert t["met"] == (t["value"] <= at_size.TARGETS[name][1] if t["bound"][0] == "<" else
                            t["value"] >= at_size.TARGETS[name][1])


def test_exactness_section_compares_greedy_tokens_with_transformers():
    """The section's check itself (on the CPU here: the native kernels; on a GPU, Triton's),
    on a few of its prompts: a cached prefix and a chunked prompt among them."""
    report = exactness.check(torch.device("cpu"), archs=("llama",), limit=None)
    row = report["models"]["llama"]
    assert report["float32_greedy_equals_transformers"] is True and row["equal"] and row["mismatched"] == []
    assert row["prompts"] == 11 and row["graph_replays"] > 0
