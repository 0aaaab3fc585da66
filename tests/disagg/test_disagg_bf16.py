"""A prefill/decode pair at bfloat16 (bf16 weights and KV cache on the CPU): the bf16 KV
crosses the wire (tcp: its dtype is checked on arrival; shm: both map a bf16 cache), and
greedy output equals the same engine's in one process, token for token."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.disagg_driver import engine_options, start_pair
from tests.support.helpers import mixed_prompts, one_torch_thread

MAX_NEW = 12
OPTIONS = {**engine_options(num_kv_blocks=256, max_model_len=512), "dtype": "bfloat16"}


@pytest.mark.parametrize("backend", ["shm", "tcp"])
def test_bf16_pair_matches_one_engine(backend, model_dirs, vocab_size, tmp_path):
    model_dir = model_dirs["llama"]
    prompts = mixed_prompts(vocab_size, seed=3)[:8]
    with one_torch_thread():
        llm = LLM(model_dir, **OPTIONS)
        params = SamplingParams(temperature=0, max_tokens=MAX_NEW)  # as the driver's requests
        want = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    dep = start_pair(model_dir, backend, OPTIONS, prefill_options={"max_num_batched_tokens": 64}, workdir=tmp_path,
                     together=True)
    try:
        result = dep.run(prompts, MAX_NEW)
        assert not result.errors, f"requests failed: {result.errors}\n{dep.logs()}"
        assert result.outputs() == want
    finally:
        dep.close()
