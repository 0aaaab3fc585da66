"""The engine decodes no text: it ends a sequence on EOS, max_tokens or max_model_len
only (stop strings belong to whoever makes the text: common/text/detokenizer.py), and a
worker's engine, given token ids, never loads the tokenizer -- while it finds the same
EOS ids as the tokenizer would give it."""
from __future__ import annotations

import pytest

from pdserve.common.config import EngineConfig
from pdserve.common.engine.engine import LLMEngine
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.text.tokenizer import Tokenizer, eos_token_id
from tests.support.helpers import ARCHS


@pytest.mark.parametrize("which", [*ARCHS, "real"])
def test_eos_id_read_without_the_tokenizer_is_the_tokenizers(which, model_dirs, request):
    model_dir = request.getfixturevalue("real_model_dir") if which == "real" else model_dirs[which]
    want = Tokenizer(model_dir).eos_token_id
    assert want is not None and eos_token_id(model_dir) == want


def _run(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> tuple[list[int], str | None]:
    seq = engine.new_sequence(prompt, params)
    engine.add(seq)
    while engine.has_work():
        engine.step()
    return seq.output_token_ids, seq.finish_reason


def test_engine_ignores_stop_strings_and_loads_no_tokenizer(model_dirs):
    engine = LLMEngine(EngineConfig.build(model_dirs["qwen3"], num_kv_blocks=16, max_model_len=128, num_threads=1))
    prompt = [5, 6, 7, 8, 9]
    plain, _ = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    text = Tokenizer(model_dirs["qwen3"]).decode(plain)
    assert text.strip(), f"the greedy output {plain} has no text to stop on"
    stop = [text.strip()[:1], text[-2:]]  # present in the text: the old engine stopped on them
    out, reason = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=stop))
    assert (out, reason) == (plain, "length")
    assert engine._tokenizer is None, "a token-id prompt loaded the tokenizer"
    assert engine.validate_prompt("hello") and engine._tokenizer is not None  # text prompts do load it
