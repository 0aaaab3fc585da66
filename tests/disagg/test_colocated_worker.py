"""The colocated worker (both phases in one process, the A/B baseline) serves the same
requests over the same wire with transformers' greedy output."""
from __future__ import annotations

from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import GenerateRequest
from tests.support.disagg_driver import engine_options, start_colocated
from tests.support.helpers import mixed_prompts

MAX_NEW = 16


def test_colocated_greedy_matches_transformers(model_dirs, vocab_size, hf_greedy, tmp_path):
    model_dir = model_dirs["qwen3"]
    prompts = mixed_prompts(vocab_size, seed=7)  # as the P/D tests: the oracle's cache is shared
    # a 64-token budget mixes chunked prefills with the decodes of earlier prompts
    dep = start_colocated(model_dir, engine_options(num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64),
                          workdir=tmp_path)
    try:
        requests = [dep.request(p, MAX_NEW) for p in prompts]
        assert all(r.prefill_addr == "" for r in requests)
        misrouted = GenerateRequest("misrouted", [5, 6], SamplingParams(temperature=0.0), prefill_addr="tcp://127.0.0.1:1")
        dep.send([*requests, misrouted])
        result = dep.collect([r.request_id for r in requests] + ["misrouted"])
        assert "colocated" in result.errors.pop("misrouted").message
        assert not result.errors, f"{result.errors}\n{dep.logs()}"
        for i, (prompt, got) in enumerate(zip(prompts, result.outputs([r.request_id for r in requests]))):
            assert got == hf_greedy(model_dir, prompt, MAX_NEW), f"prompt {i} (len {len(prompt)})"
        s = result.decode_status
        assert s.role == "colocated"
        assert s.free_blocks == s.total_blocks == 256, s
        assert s.counters["blocks_received"] == 0
    finally:
        dep.close()
