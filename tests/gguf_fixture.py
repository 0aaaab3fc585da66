"""Writing GGUF test fixtures from `pdserve make-model` folders with the `gguf` package's
writer and quantizers, laid out as llama.cpp's convert_hf_to_gguf.py lays them out
(tensor names, llama's q/k row permutation, byte-level BPE tokenizer metadata)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# quant types the gguf package can both write and read here; K-quants have no Python quantizer
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")

_LAYER = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, i, rest = hf.split(".", 3)  # model.layers.{i}.{module}.{weight|bias}
    module, kind = rest.rsplit(".", 1)
    return f"blk.{i}.{_LAYER[module]}.{kind}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order for llama (interleaved rotary halves)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str) -> Path:
    model_dir, out = Path(model_dir), Path(out)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    arch = cfg["model_type"]
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"pdserve-test-{arch}")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    # tokenizer: byte-level BPE, as llama.cpp stores a tokenizer.json's vocabulary and merges
    vocab = {**tok["model"]["vocab"], **{t["content"]: t["id"] for t in tok["added_tokens"]}}
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {t["content"] for t in tok["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(vocab[tok_cfg["eos_token"]])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_chat_template(tok_cfg["chat_template"])
    quant = gguf.GGMLQuantizationType[qtype]
    weights = load_file(str(model_dir / "model.safetensors"))
    for hf, t in sorted(weights.items()):
        t = t.astype(np.float32)
        if arch == "llama" and hf.endswith("q_proj.weight"):
            t = _permute(t, cfg["num_attention_heads"])
        if arch == "llama" and hf.endswith("k_proj.weight"):
            t = _permute(t, cfg["num_key_value_heads"])
        if t.ndim == 1:  # norms and biases stay float32, as llama.cpp keeps them
            w.add_tensor(_gguf_name(hf), t)
        else:
            w.add_tensor(_gguf_name(hf), gguf.quants.quantize(t, quant), raw_dtype=quant)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
