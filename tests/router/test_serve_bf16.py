"""`pdserve serve --dtype bfloat16`: the router's model fingerprint carries the deployment's
dtype, so its own bf16 workers register (and serve), where a float32 router would refuse
them (tests/router/test_registry.py)."""
from __future__ import annotations

import signal

import httpx
import pytest

from pdserve.common import LLM, SamplingParams
from tests.support.serving import MAX_MODEL_LEN, check_ready_file_workers, start_server, stop_server

pytestmark = pytest.mark.usefixtures("torch_one_thread_here")


def test_bf16_deployment_serves_as_one_bf16_engine(model_dirs, tmp_path):
    model_dir = model_dirs["qwen2"]
    served = start_server(model_dir, tmp_path, ["--prefill", "1", "--decode", "1"], MAX_MODEL_LEN,
                          extra=("--dtype", "bfloat16"))
    try:
        check_ready_file_workers(served, {"prefill-0": "prefill", "decode-0": "decode"})
        prompt = [5, 6, 7, 8, 9, 10, 11]
        r = httpx.post(f"{served.http}/completions", timeout=60,
                       json={"model": "qwen2", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["token_ids"]
    finally:
        stop_server(served, signal.SIGTERM)
    llm = LLM(model_dir, dtype="bfloat16", num_threads=1, num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)
    want = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert got == want[0]["token_ids"]
