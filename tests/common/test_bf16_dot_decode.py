"""bf16 decode batches through torch's bf16 matmul from the measured crossover
(kernels/crossover.py, `LinearPlan.bf16_rows`): on bf16 hardware a batch of as many rows
as a linear's crossover leaves the native decode stack, and each linear multiplies its
rows rounded to bf16 (oneDNN: AMX or AVX512_BF16). Forced here on any CPU
(PDSERVE_CPU_BF16_DOT=1 and a fixed crossover; oneDNN's bf16 also runs on AVX2, slowly):
which path ran, and its accuracy by vLLM's rule against transformers in float32 and by
perplexity. Without bf16 hardware the default takes none of it (AVX2 loses nothing)."""
from __future__ import annotations

import pytest
import torch

from pdserve import kernels
from pdserve.common import LLM, SamplingParams
from pdserve.common.engine.scoring import Divergence, first_divergence, perplexity, rank, sequence_logits
from pdserve.kernels import crossover
from pdserve.kernels.cpu_decode import DecodeStack
from tests.support.engines import TEXT

ARCHS = ("qwen3", "qwen2", "llama")
PROMPTS = ([5, 6, 7, 8, 9, 10], list(range(100, 140)), [3, 3, 3])


def make(model_dir: str, dtype: str = "bfloat16", **kw) -> LLM:
    return LLM(model_dir, num_threads=1, num_kv_blocks=64, max_model_len=256, dtype=dtype,
               enable_prefix_caching=False, **kw)


class Paths:
    """What ran from here on: the native stack's calls (rows each) and torch's bf16 matmul
    calls ((rows, whether in a pure decode step))."""

    def __init__(self, monkeypatch) -> None:
        self.stack: list[int] = []
        self.bf16: list[tuple[int, bool]] = []
        call, matmul = DecodeStack._call, kernels.LinearPlan._bf16_matmul
        monkeypatch.setattr(DecodeStack, "_call", lambda s, m, *a: self.stack.append(m) or call(s, m, *a))
        monkeypatch.setattr(kernels.LinearPlan, "_bf16_matmul", lambda s, x: self.bf16.append(
            (x.shape[0], kernels._DECODE_ROWS.get())) or matmul(s, x))


@pytest.fixture
def forced(monkeypatch):
    """forced(rows): bf16 dot products on, every shape's crossover at `rows`."""
    def force(rows: int) -> None:
        monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "1")
        monkeypatch.setenv("PDSERVE_CPU_BF16_DOT_ROWS", str(rows))
    return force


def greedy(llm: LLM, prompts, n: int) -> list[list[int]]:
    """All prompts decoded together (one decode batch of len(prompts) rows per step)."""
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o["token_ids"] for o in llm.generate(list(prompts), params, use_tqdm=False)]


def test_decode_batches_from_the_crossover_leave_the_stack_for_torchs_bf16_matmul(model_dirs, forced, monkeypatch):
    forced(4)
    llm = make(model_dirs["qwen2"], max_num_batched_tokens=512)
    model = llm.engine.runner.model
    layers = model.config.num_layers
    stack = model.decode_stack()
    assert stack is not None and stack.layer_rows == stack.head_rows == 4
    paths = Paths(monkeypatch)
    greedy(llm, [p[:6] for p in ([5, 6, 7, 8, 9, 10], list(range(100, 140)), [3] * 6)], 6)
    # 3 rows a decode step: the stack (the 18 prompt rows took the bf16 matmul, apart from it)
    assert paths.stack == [3] * 5
    assert {rows for rows, decode in paths.bf16 if decode} == set() and {rows for rows, _ in paths.bf16} == {18}
    paths.stack.clear(), paths.bf16.clear()
    greedy(llm, [[7 + i] * 6 for i in range(5)], 6)
    # 5 rows: every linear of every decode step, the lm_head too, through the bf16 matmul
    assert paths.stack == []
    assert paths.bf16.count((5, True)) == 5 * (4 * layers + 1)


def test_under_the_crossover_a_step_stays_on_the_stack_and_the_tile(model_dirs, forced, monkeypatch):
    """A crossover no batch here reaches: the stack runs every decode step, as without
    bf16 hardware, and the tokens are the widened tile's."""
    forced(64)
    llm = make(model_dirs["qwen3"])
    paths = Paths(monkeypatch)
    tokens = greedy(llm, PROMPTS, 8)
    assert paths.stack == [3] * 7 and not paths.bf16
    monkeypatch.setenv("PDSERVE_CPU_BF16_DOT", "0")
    assert greedy(make(model_dirs["qwen3"]), PROMPTS, 8) == tokens


def hf_float32(model_dir: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def against_transformers(llm: LLM, hf, prompt: list[int], ours: list[int], theirs: list[int]) -> Divergence:
    """vLLM's rule between our greedy stream and transformers' float32 one: at the first
    difference, each token's rank in the other's logits on the common prefix."""
    i = first_divergence(ours, theirs)
    if i is None or i >= min(len(ours), len(theirs)):
        return Divergence(None)
    common = prompt + ours[:i]
    la = sequence_logits(llm.engine, common)[-1]
    with torch.no_grad():
        lb = hf(torch.tensor([common])).logits[0, -1].float()
    return Divergence(i, ours[i], theirs[i], rank(lb, ours[i]), rank(la, theirs[i]))


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_matmul_decode_against_transformers_float32_top5(model_dirs, hf_greedy, forced, monkeypatch, arch):
    """Every product through the bf16 matmul (crossover 1 row: the decode batches of 3 and
    the prompts), greedy within vLLM's top-5 rule against transformers in float32."""
    forced(1)
    llm = make(model_dirs[arch], max_num_batched_tokens=512)
    paths = Paths(monkeypatch)
    ours = greedy(llm, PROMPTS, 16)
    assert not paths.stack and paths.bf16.count((3, True)) == 15 * (4 * llm.engine.runner.model.config.num_layers + 1)
    hf = hf_float32(model_dirs[arch])
    for prompt, tokens in zip(PROMPTS, ours):
        d = against_transformers(llm, hf, prompt, tokens, hf_greedy(model_dirs[arch], prompt, 16))
        assert d.within_top(5), (prompt, d)


def test_real_model_bf16_matmul_against_transformers_float32(real_model_dir, forced, monkeypatch):
    """The default model, every product of its bf16 weights through the bf16 matmul:
    greedy within the top-5 rule against transformers in float32, and the perplexity of
    the fixed text within 1% of pdserve's float32 (itself transformers' logits to float32
    rounding: tests/common/test_prompt_logprobs.py)."""
    # quantization none: the folder's float32 weights (auto would keep its GGUF's Q4_1 linears)
    f32 = make(real_model_dir, "float32", max_num_batched_tokens=512, quantization="none")
    forced(1)
    bf = make(real_model_dir, max_num_batched_tokens=512, quantization="none")
    assert bf.engine.runner.model.lm_head.plan().kind == 1 and bf.engine.runner.model.decode_stack().layer_rows == 1
    paths = Paths(monkeypatch)
    tok = bf.tokenizer
    hf = hf_float32(real_model_dir)
    for text in ("The capital of France is", "Once upon a time, in a small village,"):
        prompt = tok.encode(text)
        with torch.no_grad():
            theirs = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 max_new_tokens=24, min_new_tokens=24, do_sample=False)[0, len(prompt):].tolist()
        d = against_transformers(bf, hf, prompt, greedy(bf, [prompt], 24)[0], theirs)
        assert d.within_top(5), (text, d)
    assert not paths.stack and (1, True) in paths.bf16
    ids = tok.encode(TEXT)[:300]
    ppl = [perplexity(sequence_logits(llm.engine, ids), ids) for llm in (f32, bf)]
    assert abs(ppl[1] / ppl[0] - 1) < 0.01, ppl


@pytest.mark.skipif(kernels._bf16_dot_hardware(), reason="this CPU has bf16 dot products: by default it takes them")
def test_without_bf16_hardware_every_decode_batch_takes_the_stack(model_dirs, monkeypatch):
    """The default on an AVX2 chip: nothing measured, no crossover, every decode batch on
    the native stack whatever its size, no product through the bf16 matmul."""
    for var in ("PDSERVE_CPU_BF16_DOT", "PDSERVE_CPU_BF16_DOT_ROWS"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(crossover, "measure", lambda *a, **kw: pytest.fail("a crossover was measured"))
    llm = make(model_dirs["llama"], max_num_batched_tokens=512)
    stack = llm.engine.runner.model.decode_stack()
    assert stack.layer_rows == stack.head_rows == crossover.NEVER
    paths = Paths(monkeypatch)
    for batch in (1, 5, 17):
        greedy(llm, [[9 + i] * 4 for i in range(batch)], 3)
    assert paths.stack == [1, 1, 5, 5, 17, 17] and not paths.bf16
