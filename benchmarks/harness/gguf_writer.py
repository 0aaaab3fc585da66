"""Writing GGUF files from `pdserve make-model` folders (for tests and benchmarks) with the `gguf` package's
writer and quantizers, laid out as llama.cpp's convert_hf_to_gguf.py lays them out
(tensor names, llama's q/k row permutation, byte-level BPE tokenizer metadata). The
K-quants, which `gguf` can read but not write, are written here: their blocks packed
from given codes and scales (`pack_q4_k`, `pack_q5_k`, `pack_q6_k`) or from float
weights by plain rounding (`quantize_k`)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import load_file

# quant types the gguf package can both write and read here; K-quants have no Python quantizer
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")
K_QUANT_TYPES = ("Q4_K", "Q5_K", "Q6_K")  # written by `quantize_k`; rows of k a multiple of 256
QK_K = 256  # values per K-quant super-block

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


def write_gguf(model_dir: str | Path, out: str | Path, qtype: str, types: dict[str, str] | None = None) -> Path:
    """The model's matrices in `qtype`, except those `types` names (GGUF tensor names
    without ".weight": {"blk.0.attn_v": "Q6_K"}, as llama.cpp's Q4_K_M keeps some wider);
    norms and biases float32."""
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
    w.add_rope_freq_base(cfg["rope_theta"] if "rope_theta" in cfg else cfg["rope_parameters"]["rope_theta"])
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
    template = model_dir / "chat_template.jinja"  # transformers' own file, or the tokenizer config's entry
    w.add_chat_template(template.read_text() if template.is_file() else tok_cfg["chat_template"])
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
            name = _gguf_name(hf)
            tensor_type = (types or {}).get(name.removesuffix(".weight"), qtype)
            w.add_tensor(name, quantize(t, tensor_type), raw_dtype=gguf.GGMLQuantizationType[tensor_type])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def quantize(t: np.ndarray, qtype: str) -> np.ndarray:
    """A float32 matrix [n, k] as GGUF `qtype` blocks, uint8 [n, bytes per row]."""
    if qtype in K_QUANT_TYPES:
        return quantize_k(t, qtype)
    return gguf.quants.quantize(t, gguf.GGMLQuantizationType[qtype])


def quantize_k(t: np.ndarray, qtype: str) -> np.ndarray:
    """A float32 matrix [n, k] (k a multiple of 256) in K-quant blocks by plain rounding:
    the format llama.cpp writes, not its search for the best scales."""
    x = t.astype(np.float32).reshape(-1, QK_K)
    b = x.shape[0]
    if qtype == "Q6_K":  # per 16 values an int8 scale of d, codes -32..31
        sub = x.reshape(b, 16, 16)
        step = np.abs(sub).max(-1) / 31
        d = (step.max(-1) / 127).astype(np.float16)
        sc = np.round(_ratio(step, d[:, None])).clip(0, 127)
        q = np.round(_ratio(sub, (d[:, None].astype(np.float32) * sc)[..., None])).clip(-32, 31)
        return pack_q6_k(d, sc.astype(np.int8), q.reshape(b, QK_K).astype(np.int8)).reshape(t.shape[0], -1)
    top = {"Q4_K": 15, "Q5_K": 31}[qtype]  # per 32 values (d sc) q - (dmin m), 6-bit sc and m
    sub = x.reshape(b, 8, 32)
    lo = np.minimum(sub.min(-1), 0)
    step = (sub.max(-1) - lo) / top
    d, dmin = (step.max(-1) / 63).astype(np.float16), ((-lo).max(-1) / 63).astype(np.float16)
    sc = np.round(_ratio(step, d[:, None])).clip(0, 63)
    m = np.round(_ratio(-lo, dmin[:, None])).clip(0, 63)
    scale, offset = d[:, None].astype(np.float32) * sc, dmin[:, None].astype(np.float32) * m
    q = np.round(_ratio(sub + offset[..., None], scale[..., None])).clip(0, top).reshape(b, QK_K).astype(np.uint8)
    pack = pack_q4_k if qtype == "Q4_K" else pack_q5_k
    return pack(d, dmin, sc.astype(np.uint8), m.astype(np.uint8), q).reshape(t.shape[0], -1)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a / b, 0 where b is 0."""
    b = np.asarray(b, dtype=np.float32)
    return np.where(b == 0, 0, a / np.where(b == 0, 1, b))


def pack_q4_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """block_q4_K [b, 144] from float16 d, dmin [b], 6-bit sc, m [b, 8] and codes q [b, 256]
    in 0..15: value i of sub-block j is (d sc_j) q_i - (dmin m_j)."""
    qs = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # each 32 bytes: sub-block 2i in the low nibbles, 2i + 1 in the high
    qs = qs[:, :, 0] | (qs[:, :, 1] << 4)
    return np.concatenate([_halves(d), _halves(dmin), _scales_mins(sc, m), qs.reshape(-1, 128)], axis=1)


def pack_q5_k(d: np.ndarray, dmin: np.ndarray, sc: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """block_q5_K [b, 176]: as `pack_q4_k` with codes 0..31, their fifth bits apart (bit j
    of byte i: value i of sub-block j)."""
    q = q.reshape(-1, 8, 32)
    qh = sum(((q[:, j] >> 4) & 1) << j for j in range(8)).astype(np.uint8)  # [b, 32]
    low = pack_q4_k(d, dmin, sc, m, (q & 15).reshape(-1, QK_K))
    return np.concatenate([low[:, :16], qh, low[:, 16:]], axis=1)


def pack_q6_k(d: np.ndarray, sc: np.ndarray, q: np.ndarray) -> np.ndarray:
    """block_q6_K [b, 210] from float16 d [b], int8 scales sc [b, 16] and codes q [b, 256]
    in -32..31: value i is d sc_(i / 16) q_i. Per half of 128 values, ql's 64 bytes hold
    values 0..63 in the low nibbles and 64..127 in the high; qh's 32 bytes hold the top two
    bits of values t, t + 32, t + 64, t + 96 in bits 0-1, 2-3, 4-5, 6-7 of byte t."""
    u = (q.astype(np.int16) + 32).astype(np.uint8).reshape(-1, 2, 128)
    ql = (u[..., :64] & 15) | ((u[..., 64:] & 15) << 4)
    qh = sum((u[..., 32 * s:32 * s + 32] >> 4) << (2 * s) for s in range(4)).astype(np.uint8)
    return np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.astype(np.int8).view(np.uint8),
                           _halves(d)], axis=1)


def _halves(v: np.ndarray) -> np.ndarray:
    """float16 [b] -> its bytes [b, 2]."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(-1, 2)


def _scales_mins(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and minimums in Q4_K / Q5_K's 12 bytes (gguf-py's
    Q4_K.get_scale_min reads them): bytes 0-3 scales 0-3, 4-7 minimums 0-3, each with the
    top two bits of scale / minimum 4-7 in its bits 6-7; bytes 8-11 the low four bits of
    scales 4-7 (low nibble) and minimums 4-7 (high)."""
    sc, m = sc.astype(np.uint8), m.astype(np.uint8)
    return np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), m[:, :4] | ((m[:, 4:] >> 4) << 6),
                           (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)], axis=1)
