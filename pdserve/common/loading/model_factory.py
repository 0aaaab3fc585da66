"""`pdserve make-model`: a random-weight model directory in HuggingFace format.

Plain small-std random init makes greedy decoding collapse into one repeated token,
which would let KV-cache bugs pass unseen. Weights here are drawn at fan-in scale
(std 1/sqrt(fan_in)) so every layer mixes context strongly, and the logits keep a
spread of a few units, so greedy continuations vary and top-1 margins stay far above
float32 noise.

Two kinds of size: the test and benchmark models (`tiny`, `small`: float32, one file,
the vocabulary the trained tokenizer has) and published families' exact shapes
(`llama3-8b`, `qwen3-8b`, `qwen3-1.7b`: bf16 in shards, the published vocabulary and
RoPE settings), which are drawn on the GPU when there is one, so that an 8B model is
written in the time its 16 GB take to reach the disk.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import save_file

from pdserve.common.config import SUPPORTED_ARCHS, ConfigError
from pdserve.common.loading.model_sizes import SIZES, ModelSize  # noqa: F401  (SIZES: re-exported)
from pdserve.common.text.qwen3_template import QWEN3_ADDED_TOKENS, QWEN3_CHAT_TEMPLATE
from pdserve.common.text.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, add_plain_tokens, save_tokenizer, train_bpe_tokenizer


QK_NORM_GAIN = 3.0
_ARCH_CLASS = {"qwen3": "Qwen3ForCausalLM", "qwen2": "Qwen2ForCausalLM", "llama": "LlamaForCausalLM"}
# chat template -> (its text, the not-special added tokens it needs); "simple" takes no tools,
# "qwen3" is Qwen3's own (tools, tool responses and <think>)
CHAT_TEMPLATES = {"simple": (CHAT_TEMPLATE, []), "qwen3": (QWEN3_CHAT_TEMPLATE, QWEN3_ADDED_TOKENS)}
SHARD_BYTES = 4 << 30  # bf16 checkpoints are written in shards of about this size, as the Hub's are


def make_model(out_dir: str | Path, arch: str | None = None, size: str | ModelSize = "tiny", seed: int = 0,
               tie_word_embeddings: bool | None = None, chat_template: str = "simple", *,
               device: str | None = None, shard_bytes: int = SHARD_BYTES) -> Path:
    """Write config.json, the weights (model.safetensors, or shards and their index past
    `shard_bytes`), generation_config.json and a tokenizer whose chat template is one of
    CHAT_TEMPLATES. `arch` None: the size's family, else qwen3. `size`: a name in SIZES
    or a ModelSize. `device`: where the weights are drawn (None: the GPU for a bf16
    family when there is one, else the CPU; a seed gives other weights on another device)."""
    s = _size(size)
    arch = arch or s.arch or "qwen3"
    if arch not in SUPPORTED_ARCHS:
        raise ConfigError(f"unknown arch {arch!r} (supported: {', '.join(SUPPORTED_ARCHS)})")
    if s.arch is not None and arch != s.arch:
        raise ConfigError(f"size {size!r} is a {s.arch} model; arch {arch!r} does not fit it")
    if chat_template not in CHAT_TEMPLATES:
        raise ConfigError(f"unknown chat template {chat_template!r} (supported: {', '.join(CHAT_TEMPLATES)})")
    template, plain_tokens = CHAT_TEMPLATES[chat_template]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_bpe_tokenizer(s.vocab, seed)
    add_plain_tokens(tok, plain_tokens)
    vocab = s.model_vocab or tok.get_vocab_size()
    if vocab < tok.get_vocab_size():
        raise ConfigError(f"the model's vocabulary ({vocab}) is smaller than its tokenizer's ({tok.get_vocab_size()})")
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    tie = tie_word_embeddings if tie_word_embeddings is not None else s.tie if s.tie is not None else arch == "qwen3"
    config = hf_config(arch, s, vocab, tie, eos_id, pad_id)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": pad_id, "eos_token_id": [eos_id, pad_id], "pad_token_id": pad_id,
         "do_sample": False}, indent=2))
    save_tokenizer(tok, out, s.max_positions, template, plain_tokens)
    if device is None:
        device = "cuda" if s.dtype != "float32" and torch.cuda.is_available() else "cpu"
    write_weights(out, _weight_specs(arch, s, vocab, tie), seed, device, getattr(torch, s.dtype), shard_bytes)
    return out


def _size(size: str | ModelSize) -> ModelSize:
    if isinstance(size, ModelSize):
        return size
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r} (supported: {', '.join(SIZES)})")
    return SIZES[size]


def hf_config(arch: str, s: ModelSize, vocab: int, tie: bool, eos_id: int, pad_id: int) -> dict:
    """config.json for shape `s` as transformers writes it for `arch`."""
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
        "rms_norm_eps": s.rms_norm_eps,
        "rope_theta": s.rope_theta,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": pad_id,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "torch_dtype": s.dtype,
        "use_cache": True,
    }
    if s.rope_scaling is not None:
        config["rope_scaling"] = dict(s.rope_scaling)
    if arch == "llama":
        config.update(mlp_bias=False, pretraining_tp=1)
    if arch in ("qwen2", "qwen3"):
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=s.layers)
    return config


# (name, shape, draw): draw(generator, device) -> the float32 tensor
WeightSpec = tuple[str, tuple[int, ...], Callable[[torch.Generator, str], torch.Tensor]]


def _weight_specs(arch: str, s: ModelSize, vocab: int, tie: bool) -> list[WeightSpec]:
    """Every tensor of the checkpoint with how it is drawn, in the order the draws consume
    one generator (the order fixes the bits a seed gives)."""
    def fan_in(name: str, out_f: int, in_f: int, gain: float = 1.0) -> WeightSpec:
        return name, (out_f, in_f), lambda g, dev: torch.randn(out_f, in_f, generator=g, device=dev) * (gain / math.sqrt(in_f))

    def near_one(name: str, n: int, gain: float = 1.0) -> WeightSpec:
        if gain == 1.0:
            return name, (n,), lambda g, dev: 1.0 + 0.1 * torch.randn(n, generator=g, device=dev)
        return name, (n,), lambda g, dev: gain * (1.0 + 0.1 * torch.randn(n, generator=g, device=dev))

    def normal(name: str, shape: tuple[int, ...], std: float) -> WeightSpec:
        return name, shape, lambda g, dev: std * torch.randn(*shape, generator=g, device=dev)

    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    # Tied: the embedding doubles as the output head, so keep it small next to the layer
    # outputs; otherwise each token's own embedding dominates and greedy repeats it.
    embed_std = 2.0 / math.sqrt(s.hidden) if tie else 1.0
    w = [normal("model.embed_tokens.weight", (vocab, s.hidden), embed_std)]
    for i in range(s.layers):
        p = f"model.layers.{i}."
        w += [fan_in(p + "self_attn.q_proj.weight", q, s.hidden, gain=2.0),
              fan_in(p + "self_attn.k_proj.weight", kv, s.hidden, gain=2.0),
              fan_in(p + "self_attn.v_proj.weight", kv, s.hidden),
              fan_in(p + "self_attn.o_proj.weight", s.hidden, q)]
        if arch == "qwen2":
            w += [normal(p + f"self_attn.{name}_proj.bias", (n,), 0.1) for name, n in (("q", q), ("k", kv), ("v", kv))]
        if arch == "qwen3":
            # q/k norms fix the score scale; a gain > 1 keeps attention from going flat
            w += [near_one(p + "self_attn.q_norm.weight", s.head_dim, QK_NORM_GAIN),
                  near_one(p + "self_attn.k_norm.weight", s.head_dim, QK_NORM_GAIN)]
        w += [fan_in(p + "mlp.gate_proj.weight", s.intermediate, s.hidden),
              fan_in(p + "mlp.up_proj.weight", s.intermediate, s.hidden),
              fan_in(p + "mlp.down_proj.weight", s.hidden, s.intermediate),
              near_one(p + "input_layernorm.weight", s.hidden),
              near_one(p + "post_attention_layernorm.weight", s.hidden)]
    w.append(near_one("model.norm.weight", s.hidden))
    if not tie:
        w.append(fan_in("lm_head.weight", vocab, s.hidden, gain=3.0))
    return w


def write_weights(out: Path, specs: list[WeightSpec], seed: int, device: str, dtype: torch.dtype,
                  shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """Draw every tensor of `specs` on `device` from one generator seeded `seed`, round it
    to `dtype` and write the whole as model.safetensors, or, past `shard_bytes`, as
    model-0000i-of-0000n.safetensors with model.safetensors.index.json (the Hub's names).
    Shards are planned from the shapes first, then each is drawn and written in turn: the
    host holds one shard at a time."""
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list[WeightSpec]] = [[]]
    held = 0
    for spec in specs:
        nbytes = math.prod(spec[1]) * size
        if shards[-1] and held + nbytes > shard_bytes:
            shards.append([])
            held = 0
        shards[-1].append(spec)
        held += nbytes
    n = len(shards)
    names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    gen = torch.Generator(device=device).manual_seed(seed)
    weight_map: dict[str, str] = {}
    for name, shard in zip(names, shards):
        tensors = {key: draw(gen, device).to(dtype).cpu().contiguous() for key, _, draw in shard}
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        del tensors
    if n > 1:
        total = sum(math.prod(shape) for _, shape, _ in specs) * size
        (out / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [out / name for name in names]
