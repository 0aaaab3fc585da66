"""`pdserve make-model`: a random-weight model directory in HuggingFace format.

Plain small-std random init makes greedy decoding collapse into one repeated token,
which would let KV-cache bugs pass unseen. Weights here are drawn at fan-in scale
(std 1/sqrt(fan_in)) so every layer mixes context strongly, and the logits keep a
spread of a few units, so greedy continuations vary and top-1 margins stay far above
float32 noise.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.common.config import SUPPORTED_ARCHS, ConfigError
from pdserve.common.text.qwen3_template import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE
from pdserve.common.text.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, add_plain_tokens, save_tokenizer, train_bpe_tokenizer


@dataclass(frozen=True)
class ModelSize:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # BPE training target; the trained vocabulary may come out smaller
    max_positions: int


SIZES = {
    # a test model: ~1M parameters, fast enough for token-exact tests on 2 cores
    "tiny": ModelSize(hidden=128, intermediate=384, layers=4, heads=4, kv_heads=2, head_dim=32,
                      vocab=2048, max_positions=2048),
    # a benchmark model: ~40M parameters, Qwen3-0.6B-like ratios with fewer layers
    "small": ModelSize(hidden=512, intermediate=1536, layers=12, heads=8, kv_heads=4, head_dim=64,
                       vocab=8192, max_positions=4096),
}
QK_NORM_GAIN = 3.0
_ARCH_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# chat template -> (its text, the not-special added tokens it needs); "simple" takes no tools,
# "qwen3" is Qwen3's own (tools, tool responses and <think>)
CHAT_TEMPLATES = {"simple": (CHAT_TEMPLATE, []), "qwen3": (QWEN3_CHAT_TEMPLATE, QWEN3_ADDED_TOKENS)}


def make_model(out_dir: str | Path, arch: str = "qwen3", size: str = "tiny", seed: int = 0,
               tie_word_embeddings: bool | None = None, chat_template: str = "simple") -> Path:
    """Write config.json, model.safetensors, generation_config.json and a tokenizer whose
    chat template is one of CHAT_TEMPLATES."""
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"unknown arch {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r} (supported: {', '.join(SIZES)})")
    if chat_template not in CHAT_TEMPLATES:
        raise ConfigError(f"unknown chat template {chat_template!r} (supported: {', '.join(CHAT_TEMPLATES)})")
    template, plain_tokens = CHAT_TEMPLATES[chat_template]
    s = SIZES[size]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe_tokenizer(s.vocab, seed)
    add_plain_tokens(tok, plain_tokens)
    vocab = tok.get_vocab_size()
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    tie = (arch == "qwen3") if tie_word_embeddings is None else tie_word_embeddings
    config = {
        "architectures": [_ARCH_CLASS[arch]],
        "model_type": arch,
        "vocab_size": vocab,
        "hidden_size": s.hidden,
        "intermediate_size": s.intermediate,
        "num_hidden_layers": s.layers,
        "num_attention_heads": s.heads,
        "num_key_value_heads": s.kv_heads,
        "head_dim": s.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": s.max_positions,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": pad_id, "eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id,
         "do_sample": False}, indent=2))
    save_tokenizer(tok, out, s.max_positions, template, plain_tokens)
    save_file(_random_weights(arch, s, vocab, tie, seed), str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def _random_weights(arch: str, s: ModelSize, vocab: int, tie: bool, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def fan_in(out_f: int, in_f: int, gain: float = 1.0) -> torch.Tensor:
        return torch.randn(out_f, in_f, generator=g) * (gain / math.sqrt(in_f))

    def near_one(n: int) -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # Tied: the embedding doubles as the output head, so keep it small next to the layer
    # outputs; otherwise each token's own embedding dominates and greedy repeats it.
    embed_std = 2.0 / math.sqrt(s.hidden) if tie else 1.0
    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": embed_std * torch.randn(vocab, s.hidden, generator=g)}
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w[p + "self_attn.q_proj.weight"] = fan_in(q, s.hidden, gain=2.0)
        w[p + "self_attn.k_proj.weight"] = fan_in(kv, s.hidden, gain=2.0)
        w[p + "self_attn.v_proj.weight"] = fan_in(kv, s.hidden)
        w[p + "self_attn.o_proj.weight"] = fan_in(s.hidden, q)
        if arch == "qwen2":
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = 0.1 * torch.randn(n, generator=g)
        if arch == "qwen3":
            # q/k norms fix the score scale; a gain > 1 keeps attention from going flat
            w[p + "self_attn.q_norm.weight"] = QK_NORM_GAIN * near_one(s.head_dim)
            w[p + "self_attn.k_norm.weight"] = QK_NORM_GAIN * near_one(s.head_dim)
        w[p + "mlp.gate_proj.weight"] = fan_in(s.intermediate, s.hidden)
        w[p + "mlp.up_proj.weight"] = fan_in(s.intermediate, s.hidden)
        w[p + "mlp.down_proj.weight"] = fan_in(s.hidden, s.intermediate)
        w[p + "input_layernorm.weight"] = near_one(s.hidden)
        w[p + "post_attention_layernorm.weight"] = near_one(s.hidden)
    w["model.norm.weight"] = near_one(s.hidden)
    if not tie:
        w["lm_head.weight"] = fan_in(vocab, s.hidden, gain=3.0)
    return {k: v.contiguous() for k, v in w.items()}
