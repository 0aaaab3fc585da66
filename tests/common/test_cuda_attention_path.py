"""The engine's CUDA attention path, run on the CPU: every attention call goes where it goes
on a GPU -- store_kv, decode attention and the varlen prefill attention to their Triton
kernels (through Triton's interpreter, TRITON_INTERPRET=1 from the tests' conftest) -- with
the CPU's native attention and decode stack turned off. Prompts with shared prefixes
(cached blocks read in place by later prompts), chunked by a small token budget (a chunk
reads the earlier chunks from the cache), decode steps through the graph runner's static
buffers: greedy tokens equal transformers' at float32."""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.common.engine import model_runner
from pdserve.common.engine.llm import LLM
from pdserve.common.sampling_params import SamplingParams
from tests.support.helpers import mixed_prompts

pytest.importorskip("triton")


@pytest.fixture
def cuda_dispatch(monkeypatch):
    """Each kernel dispatcher and the attention take their Triton branch, as for CUDA tensors;
    counts the calls of the varlen prefill kernel."""
    calls = []
    prefill = kernels.triton_paged_prefill_attention

    def counted(*args, **kw):
        calls.append(args[4].shape[0] - 1)  # sequences in the call
        return prefill(*args, **kw)

    monkeypatch.setattr(kernels, "use_triton", lambda t: True)
    # the cache in the GPU's memory order (kv_layout.kv_cache_tensor): block, token, head, dim
    monkeypatch.setattr(model_runner, "kv_cache_tensor", lambda shape, dtype, device: torch.zeros(shape, dtype=dtype))
    monkeypatch.setattr(kernels, "triton_paged_prefill_attention", counted)
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")  # no native attention, no native decode stack
    return calls


@pytest.mark.parametrize("arch,graphs", [("qwen3", True), ("llama", False)])
def test_greedy_through_the_triton_kernels_equals_transformers(model_dirs, hf_greedy, cuda_dispatch, arch, graphs):
    d = model_dirs[arch]
    every = mixed_prompts(2000, seed=11)
    prompts = [every[2], every[7], every[10], every[-4], every[-2]]  # 15, 47, 100 tokens; two sharing 48
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=256, max_model_len=512, max_num_batched_tokens=64,
              decode_graphs=graphs, seed=0)
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    assert [o["token_ids"] for o in outs] == [hf_greedy(d, p, 4) for p in prompts]
    assert any(o["num_cached_tokens"] for o in outs)  # some prompts read a cached prefix
    assert max(cuda_dispatch) > 1  # several prompts' chunks in one kernel call
    if graphs:
        assert llm.engine.runner.replays > 0
