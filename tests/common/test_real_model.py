"""The default model (SmolLM2-135M-Instruct, converted from the wheel's GGUF) in the
offline engine: as it runs by default (its GGUF's Q4_1 linears, int8 dot products in
decode) it answers a question; its float32 conversion (`quantization="none"`) gives
transformers' greedy output token for token, on chat and plain prompts, ASCII and not;
text is decode(tokens) with special tokens skipped. The quantized default against float32
by vLLM's top-5 rule: tests/common/test_quantization.py."""
from __future__ import annotations

import pytest

from pdserve.common import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_NEW = 12
QUESTIONS = ["Écris une phrase sur le café et la crème brûlée.", "Translate to German: the weather is nice 🌞"]
PLAIN = ["Ñandú, pingüino y 🐧 son", "日本の首都は"]


@pytest.fixture(scope="module")
def llm(real_model_dir) -> LLM:
    return LLM(real_model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256)


@pytest.fixture(scope="module")
def llm_f32(real_model_dir) -> LLM:
    return LLM(real_model_dir, dtype="float32", num_kv_blocks=64, max_model_len=256, quantization="none")


def test_the_default_model_answers_a_question(llm):
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert out["text"] == "The capital of France is Paris."
    assert out["finish_reason"] == "stop"  # on <|im_end|>, which never shows in the text


def test_greedy_matches_transformers(llm_f32, real_model_dir, hf_greedy):
    llm, tok = llm_f32, llm_f32.tokenizer
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    prompts += [tok.encode(p) for p in PLAIN]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)
    for ids, out in zip(prompts, outs):
        assert out["token_ids"] == hf_greedy(real_model_dir, ids, MAX_NEW)
        assert out["text"] == tok.decode(out["token_ids"], skip_special_tokens=True)
        assert "<|im_end|>" not in out["text"]
        if out["finish_reason"] == "stop":  # a length cut may end inside a character: decode shows U+FFFD there
            assert "\ufffd" not in out["text"]


def test_transformers_tokenizer_agrees(real_model_dir, llm):
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(real_model_dir)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Qué tal? 🎉"}]
    ours = llm.tokenizer.apply_chat_template(msgs)
    assert ours == hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    for text in [ours, *PLAIN, *QUESTIONS]:
        assert llm.tokenizer.encode(text) == hf.encode(text, add_special_tokens=False)
