"""bf16 on the CPU (common.models.precision): bf16 weights through the native GEMM and a
bf16 KV cache, float32 activations, norms and logits; and its accuracy by vLLM's rule below
float32 (greedy against float32; where the streams first differ, each side's token in the
other's top-5) and by perplexity, on the tiny random models and on the real default."""
from __future__ import annotations

import pytest
import torch

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import DeviceConfig
from pdserve.common.engine.scoring import Divergence, divergence, first_divergence, perplexity, rank, sequence_logits
from pdserve.common.models.layers import Linear
from pdserve.common.models.precision import activation_dtype, kv_cache_dtype
from tests.support.engines import TEXT

ARCHS = ("qwen3", "qwen2", "llama")  # qwen3's make-model ties the lm_head to the embeddings


def make(model_dir: str, dtype: str, **kw) -> LLM:
    return LLM(model_dir, num_threads=1, num_kv_blocks=64, max_model_len=256, dtype=dtype,
               enable_prefix_caching=False, **kw)


def greedy(llm: LLM, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]


def test_dtype_policy():
    cpu_bf16, cpu_f32 = DeviceConfig(dtype="bfloat16"), DeviceConfig(dtype="float32")
    assert activation_dtype(cpu_bf16) == torch.float32 and kv_cache_dtype(cpu_bf16) == torch.bfloat16
    assert activation_dtype(cpu_f32) == torch.float32
    assert activation_dtype(DeviceConfig(dtype="float16")) == torch.float16  # the whole model cast, as before


@pytest.mark.parametrize("arch", ["qwen3", "qwen2"])
def test_bf16_holds_linears_and_embeddings_in_bf16_and_the_rest_in_float32(model_dirs, arch):
    f32, bf = make(model_dirs[arch], "float32").engine, make(model_dirs[arch], "bfloat16").engine
    model = bf.runner.model
    for name, p in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0])
        narrowed = isinstance(owner, (Linear, torch.nn.Embedding)) and name.endswith("weight")
        assert p.dtype == (torch.bfloat16 if narrowed else torch.float32), name
        # the float32 engine's weight rounded to nearest even (or kept, where float32)
        assert torch.equal(p, f32.runner.model.get_parameter(name).to(p.dtype)), name
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.plan().packed.dtype == torch.bfloat16
    assert bf.runner.kv_cache.dtype == torch.bfloat16
    stack = model.decode_stack()
    assert stack is not None and stack.layers[0].down_p.dtype == torch.bfloat16
    logits = sequence_logits(bf, [5, 6, 7])
    assert logits.dtype == torch.float32 and logits.shape == (3, model.config.vocab_size)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_bf16_against_float32_top5(model_dirs, arch):
    f32, bf = make(model_dirs[arch], "float32"), make(model_dirs[arch], "bfloat16")
    for prompt in ([5, 6, 7, 8, 9, 10], list(range(100, 140)), [3, 3, 3]):
        d = divergence(prompt, greedy(f32, prompt, 24), greedy(bf, prompt, 24), f32.engine, bf.engine)
        assert d.within_top(5), (prompt, d)


def test_real_model_bf16_against_float32(real_model_dir):
    """The default model (float32 weights on disk; their bf16 rounding is its bf16 model):
    greedy within the top-5 rule, and perplexity of a fixed text within 1% of float32's
    (seen: 93.17 vs 93.16 on the README's first 400 tokens)."""
    f32, bf = (make(real_model_dir, dt, max_num_batched_tokens=512) for dt in ("float32", "bfloat16"))
    tok = f32.tokenizer
    for text in ("The capital of France is", "Once upon a time, in a small village,"):
        prompt = tok.encode(text)
        d = divergence(prompt, greedy(f32, prompt, 32), greedy(bf, prompt, 32), f32.engine, bf.engine)
        assert d.within_top(5), (text, d)
    ids = tok.encode(TEXT)[:300]
    ppl = [perplexity(sequence_logits(llm.engine, ids), ids) for llm in (f32, bf)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.01, ppl


def test_divergence_helpers():
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2
    logits = torch.tensor([0.1, 3.0, 2.0, 3.0])
    assert rank(logits, 1) == rank(logits, 3) == 0 and rank(logits, 2) == 2 and rank(logits, 0) == 3
    assert Divergence(None).within_top(5)
    assert Divergence(4, 7, 8, 1, 4).within_top(5) and not Divergence(4, 7, 8, 5, 0).within_top(5)
    # a perfect prediction of every next token has perplexity 1
    ids = [0, 1, 2, 3]
    sure = torch.full((4, 5), -1e9)
    sure[torch.arange(3), torch.tensor(ids[1:])] = 0.0
    assert perplexity(sure, ids) == pytest.approx(1.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_bf16_against_transformers_bf16_top5(model_dirs, arch):
    """The reference at the same dtype: transformers' bf16 model (bf16 activations too)."""
    from transformers import AutoModelForCausalLM
    ours = make(model_dirs[arch], "bfloat16")
    hf = AutoModelForCausalLM.from_pretrained(model_dirs[arch], dtype=torch.bfloat16).eval()
    for prompt in ([5, 6, 7, 8, 9, 10], list(range(100, 140))):
        a = greedy(ours, prompt, 16)
        with torch.no_grad():
            b = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                            max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(prompt):].tolist()
        i = first_divergence(a, b)
        if i is None:
            continue
        common = prompt + a[:i]
        la = sequence_logits(ours.engine, common)[-1]
        with torch.no_grad():
            lb = hf(torch.tensor([common])).logits[0, -1].float()
        assert Divergence(i, a[i], b[i], rank(lb, a[i]), rank(la, b[i])).within_top(5), (prompt, i, a, b)


def test_bf16_without_the_native_kernels(model_dirs, monkeypatch):
    """PDSERVE_CPU_ATTENTION=torch (or no compiler): the same bf16 weights and cache through
    torch, widened op by op; the same greedy tokens as the native path (float32 arithmetic
    in both, only summation orders differ)."""
    prompts = [list(range(100, 140)), [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=12)
    native = [o["token_ids"] for o in make(model_dirs["qwen2"], "bfloat16").generate(prompts, params, use_tqdm=False)]
    monkeypatch.setenv("PDSERVE_CPU_ATTENTION", "torch")
    llm = make(model_dirs["qwen2"], "bfloat16")
    assert llm.engine.runner.kv_cache.dtype == torch.bfloat16 and llm.engine.runner.model.decode_stack() is None
    assert [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)] == native
