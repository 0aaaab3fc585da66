"""The forward's `keep` rows (common/models/decoder.py): the last layer's MLP runs on the
sampled rows alone. Their hidden states are those of the full forward, every row's K/V
still reaches the cache, and a step that samples nothing (a prompt's middle chunk)
returns no rows. Greedy output against transformers goes through it (tests/common,
tests/disagg)."""
from __future__ import annotations

import pytest
import torch

from pdserve.common import LLM, SamplingParams


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_kept_rows_equal_the_full_forward_and_every_row_is_stored(model_dirs, arch):
    engine = LLM(model_dirs[arch], dtype="float32", num_threads=1, num_kv_blocks=64, max_model_len=256).engine
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    seqs = [engine.new_sequence([3 + (5 * i + j) % 150 for j in range(n)], params) for i, n in enumerate((40, 17, 33))]
    for s in seqs:
        engine.add(s)
    sched = engine.scheduler.schedule()
    assert sorted(sched.num_tokens) == [17, 33, 40]  # three whole prompts in one step
    ids, positions, meta, sample_idx, _ = engine.runner.prepare(sched.seqs, sched.num_tokens)
    model = engine.runner.model
    with torch.inference_mode():
        full = model(ids, positions, meta)
        cache_full = [c.clone() for kv in model.kv_caches for c in kv]
        for kv in model.kv_caches:
            for c in kv:
                c.zero_()
        kept = model(ids, positions, meta, keep=sample_idx)
        cache_kept = [c.clone() for kv in model.kv_caches for c in kv]
        none = model(ids, positions, meta, keep=sample_idx[:0])
    assert kept.shape == (3, full.shape[1]) and none.shape == (0, full.shape[1])
    torch.testing.assert_close(kept, full[sample_idx], rtol=1e-5, atol=1e-5)
    assert all(torch.equal(a, b) for a, b in zip(cache_full, cache_kept)) and any(c.any() for c in cache_kept)
