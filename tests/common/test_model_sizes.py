"""`pdserve make-model --size llama3-8b | qwen3-8b | qwen3-1.7b`: the published families'
shapes (config.json against the published values, parameter counts against the model
cards, transformers' own reading of the config), and a scaled-down copy of each family,
bf16 in shards on disk, loading in the engine and in transformers with the same greedy
tokens at float32."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from pdserve.common.config import ConfigError, ModelConfig
from pdserve.common.engine.llm import LLM
from pdserve.common.loading.model_factory import SIZES, hf_config, make_model
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.cli.main import main as cli_main
from tests.support.helpers import mixed_prompts

# The published config.json values (meta-llama/Llama-3.1-8B, Qwen/Qwen3-8B, Qwen/Qwen3-1.7B),
# written out a second time here so that a typo in SIZES fails.
PUBLISHED = {
    "llama3-8b": dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
                      max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                      torch_dtype="bfloat16",
                      rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                    "original_max_position_embeddings": 8192, "rope_type": "llama3"}),
    "qwen3-8b": dict(model_type="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False,
                     torch_dtype="bfloat16", max_window_layers=36, use_sliding_window=False),
    "qwen3-1.7b": dict(model_type="qwen3", hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                       num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                       max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                       torch_dtype="bfloat16", max_window_layers=28, use_sliding_window=False),
}
# The model cards' parameter counts in billions, to the digits they give: (total, without the
# embedding and an untied lm_head)
CARD_PARAMS = {"llama3-8b": ("8.03", None), "qwen3-8b": ("8.2", "6.95"), "qwen3-1.7b": ("1.7", "1.4")}


def as_card_says(count: int, figure: str) -> str:
    """`count` in billions, rounded to as many decimals as the card's `figure` has."""
    return f"{count / 1e9:.{len(figure.split('.')[1])}f}"


def family_config(name: str) -> dict:
    s = SIZES[name]
    return hf_config(s.arch, s, s.model_vocab, s.tie, eos_id=1, pad_id=0)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_family_config_is_the_published_one(name):
    cfg = family_config(name)
    assert {k: cfg.get(k) for k in PUBLISHED[name]} == PUBLISHED[name]
    assert "rope_scaling" in cfg if name.startswith("llama") else "rope_scaling" not in cfg


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_family_parameter_count_is_the_model_cards(name, tmp_path):
    """Counted three ways: ModelSize.num_parameters, transformers' model built from the
    config (on the meta device: no memory), and the model card's rounded figure."""
    from transformers import AutoConfig, AutoModelForCausalLM
    s = SIZES[name]
    (tmp_path / "config.json").write_text(json.dumps(family_config(name)))
    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    theirs = sum(p.numel() for p in hf.parameters())  # a tied lm_head is one parameter
    assert theirs == s.num_parameters()
    total, body = CARD_PARAMS[name]
    assert as_card_says(theirs, total) == total
    if body is not None:
        embeddings = s.model_vocab * s.hidden * (1 if s.tie else 2)
        assert as_card_says(theirs - embeddings, body) == body
    ours = ModelConfig.from_dir(tmp_path)
    assert (ours.head_dim, ours.num_kv_heads, ours.qk_norm, ours.tie_word_embeddings) == (128, 8, s.arch == "qwen3", s.tie)
    if name == "llama3-8b":
        assert (ours.rope.rope_type, ours.rope.factor, ours.rope.original_max_position_embeddings) == ("llama3", 8.0, 8192)
        assert hf.config.rope_parameters["rope_type"] == "llama3"


def test_a_family_size_fixes_its_arch(tmp_path):
    with pytest.raises(ConfigError, match="is a llama model; arch 'qwen3' does not fit it"):
        make_model(tmp_path / "m", "qwen3", "llama3-8b")
    assert not (tmp_path / "m").exists()  # refused before anything is written


# scaled down: the family's head_dim, GQA, norms, RoPE and tying; a model vocabulary past
# the tokenizer's (as the published families' is)
SCALED = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, model_vocab=4096)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_scaled_family_is_bf16_shards_and_greedy_equals_transformers(name, tmp_path, hf_greedy):
    s = SIZES[name].scaled(**SCALED)
    d = make_model(tmp_path / name, size=s, seed=3, shard_bytes=1 << 20)  # ~2 MB of weights: several shards
    index = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((d / f).is_file() for f in shards)
    with safe_open(str(d / shards[0]), framework="pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["vocab_size"] == 4096 and cfg["head_dim"] == 128 and cfg.get("rope_scaling") == SIZES[name].rope_scaling
    tokenizer_vocab = json.loads((d / "tokenizer.json").read_text())["model"]["vocab"]
    assert len(tokenizer_vocab) < cfg["vocab_size"]
    prompts = mixed_prompts(cfg["vocab_size"], seed=5)[::3]  # ids past the tokenizer's vocabulary too
    llm = LLM(d, dtype="float32", device="cpu", num_kv_blocks=128, max_model_len=512, seed=0)
    got = [o["token_ids"] for o in llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)]
    assert got == [hf_greedy(str(d), p, 8) for p in prompts]
    assert len({tuple(t) for t in got}) > 1  # not one repeated stream


def test_make_model_cli_writes_a_family_model(tmp_path, monkeypatch, capsys):
    """The CLI's --size takes the families (here llama3-8b made tiny, to stay fast)."""
    from pdserve.common.loading import model_factory
    monkeypatch.setitem(model_factory.SIZES, "llama3-8b", SIZES["llama3-8b"].scaled(**SCALED))
    assert cli_main(["make-model", str(tmp_path / "m"), "--size", "llama3-8b"]) == 0
    assert "wrote llama/llama3-8b" in capsys.readouterr().out
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "bfloat16"
