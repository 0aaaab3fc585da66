"""A GGUF file's Q8_0 / Q4_0 / Q4_1 linear weights, repacked for the native GEMM as they are
stored (`kernels.quant.from_gguf`: no dequantize, no re-quantize), for the folder converted
from it (`--quantization gguf`, common/quantization.py). The same tensor names and row
order as the conversion (transformers' GGUF loader): llama's q/k rows un-permuted, q/k/v
and gate/up fused as the model fuses them."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from common.config import ConfigError, ModelConfig
from kernels import quant
from kernels.quant import QuantWeight

# our fused Linear -> the GGUF tensors (per layer) it is made of, in row order
_LAYER_LINEARS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                  "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}


def gguf_linears(path: Path, cfg: ModelConfig) -> dict[str, QuantWeight]:
    """Our Linear module names ("model.layers.0.self_attn.qkv_proj", "lm_head") -> the
    weight the GGUF file holds for it, for each whose tensors are all of one kept type
    (Q8_0, Q4_0, Q4_1); the others are absent (they stay float)."""
    from gguf import GGUFReader
    try:
        tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    out: dict[str, QuantWeight] = {}
    for i in range(cfg.num_layers):
        for ours, names in _LAYER_LINEARS.items():
            parts = [_weight(tensors.get(f"blk.{i}.{name}.weight"), name, cfg) for name in names]
            if all(p is not None for p in parts) and len({p.kind for p in parts}) == 1:
                out[f"model.layers.{i}.{ours}"] = _concat(parts)
    head = _weight(tensors.get("output.weight") or (tensors.get("token_embd.weight") if cfg.tie_word_embeddings
                                                    else None), "output", cfg)
    if head is not None:
        out["lm_head"] = head
    return out


def _weight(t, name: str, cfg: ModelConfig) -> QuantWeight | None:
    """A GGUF tensor [n, k] of a kept type, repacked; None for another type or none."""
    if t is None or t.tensor_type.name not in quant.GGUF_KINDS or len(t.shape) != 2:
        return None
    k, n = (int(v) for v in t.shape)  # GGUF lists the innermost dimension first
    w = quant.from_gguf(t.tensor_type.name, np.asarray(t.data), n, k)
    if cfg.arch == "llama" and name in ("attn_q", "attn_k"):
        heads = cfg.num_heads if name == "attn_q" else cfg.num_kv_heads
        w = quant.permute_rows(w, _unpermute_order(n, heads))
    return w


def _unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """The row order that undoes llama.cpp's q/k permutation (transformers'
    reverse_permute_weights, applied to row indices)."""
    idx = torch.arange(rows)
    return idx.reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def _concat(parts: list[QuantWeight]) -> QuantWeight:
    if len(parts) == 1:
        return parts[0]
    unpacked = [quant.unpack(p) for p in parts]
    q, d = torch.cat([u[0] for u in unpacked]), torch.cat([u[1] for u in unpacked])
    m = None if unpacked[0][2] is None else torch.cat([u[2] for u in unpacked])
    return quant.pack(parts[0].kind, q, d, m)
