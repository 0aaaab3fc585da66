"""A GGUF file's quantized linear weights in the native GEMM's kinds, for the folder
converted from it (`--quantization gguf`, common/quantization.py). The same tensor names
and row order as the conversion (transformers' GGUF loader): llama's q/k rows
un-permuted, q/k/v and gate/up fused as the model fuses them.

How each GGUF type is kept (`KEPT`):
    Q8_0, Q4_0, Q4_1  repacked as stored (`kernels.quant.from_gguf`): the conversion's
                      weights bit for bit
    Q4_K              q4_1 with the file's codes, each 32 values' scale and minimum
                      rounded to float16 (`_q4_k`)
    Q5_K, Q6_K, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS
                      q8_0 re-quantized from gguf-py's dequantized values: per 32 values
                      within half a q8_0 step (d / 2, d = max |w| / 127 in float16)
A fused Linear whose parts keep different kinds (a Q4_K_M file's Q6_K attn_v beside Q4_K
attn_q / attn_k) is q8_0, each part re-quantized from its dequantized values unless it is
q8_0 already. llama.cpp writes the Q5_0 / Q5_1 / Q8_0 / IQ4_NL fallbacks into a K-quant
file for rows whose length is not a multiple of 256 (SmolLM2's 576: most of a Q4_K_M
SmolLM2 is Q5_0), so those are kept too. Other types (F32, F16, BF16, the other IQ types)
stay float.

`cached_gguf_linears` keeps the repacked weights in the converted folder
(`gguf_linears.cache`, a safetensors file, keyed by the GGUF file's path, size and mtime, the shapes that
decide the repacking and `CACHE_FORMAT`): gguf-py's reader parses every metadata field
before it lists a tensor (the default SmolLM2's 49k-token vocabulary and merges: ~7 s of a
cold `pdserve generate`'s 12 on a 2-core Zen 3), and the cache is read in well under one."""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch

from pdserve.common.config import ConfigError, ModelConfig
from pdserve.kernels import quant
from pdserve.kernels.atomic_file import replaced
from pdserve.kernels.quant import QuantWeight

# GGUF type -> the kind its linears are kept in
KEPT = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_1",
        **dict.fromkeys(("Q5_K", "Q6_K", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"), "q8_0")}
# our fused Linear -> the GGUF tensors (per layer) it is made of, in row order
_LAYER_LINEARS = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
                  "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}
Q4_K_BYTES = 144  # block_q4_K: float16 d, float16 dmin, 12 bytes of 6-bit scales and minimums, 128 of codes
CACHE_FILE = "gguf_linears.cache"  # in the converted folder: safetensors, named so that no loader takes it for weights
CACHE_FORMAT = "1"  # change it whenever what `gguf_linears` makes for a file changes

log = logging.getLogger(__name__)


def cached_gguf_linears(path: Path, cfg: ModelConfig, folder: str | Path) -> dict[str, QuantWeight]:
    """`gguf_linears(path, cfg)`, read from `folder`'s cache where it holds this file's
    (same path, size, mtime, model shapes, format), else made and written there (atomically;
    a folder we cannot write to is only not cached)."""
    key = _cache_key(path, cfg)
    cache = Path(folder) / CACHE_FILE
    cached = _read_cache(cache, key)
    if cached is not None:
        return cached
    out = gguf_linears(path, cfg)
    try:
        _write_cache(cache, key, out)
    except OSError as e:
        log.info("not caching the repacked GGUF linears in %s: %s", folder, e)
    return out


def _cache_key(path: Path, cfg: ModelConfig) -> str:
    st = path.stat()
    fields = [CACHE_FORMAT, str(path.resolve()), st.st_size, st.st_mtime_ns, cfg.arch, cfg.num_layers,
              cfg.num_heads, cfg.num_kv_heads, cfg.tie_word_embeddings]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _read_cache(cache: Path, key: str) -> dict[str, QuantWeight] | None:
    """The cached weights, or None where there are none for `key` (absent, stale, unreadable
    or not of the shapes their kinds make)."""
    from safetensors import SafetensorError, safe_open
    try:
        with safe_open(str(cache), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("key") != key:
                return None
            out = {}
            for name, (kind, n, k) in json.loads(meta["weights"]).items():
                data = f.get_tensor(name)
                if data.dtype != torch.uint8 or tuple(data.shape) != (-(-n // quant.PANEL),
                                                                       k // quant.GROUP * quant.block_bytes(kind)):
                    return None
                out[name] = QuantWeight(kind, n, k, data)
            return out
    except (OSError, ValueError, KeyError, TypeError, SafetensorError):  # remade
        return None


def _write_cache(cache: Path, key: str, weights: dict[str, QuantWeight]) -> None:
    from safetensors.torch import save_file
    meta = {"key": key, "weights": json.dumps({name: [w.kind, w.n, w.k] for name, w in weights.items()})}
    with replaced(cache) as tmp:  # several workers may load one folder at once
        save_file({name: w.data.contiguous() for name, w in weights.items()}, tmp, metadata=meta)


def gguf_linears(path: Path, cfg: ModelConfig) -> dict[str, QuantWeight]:
    """Our Linear module names ("model.layers.0.self_attn.qkv_proj", "lm_head") -> the
    weight the GGUF file holds for it, for each whose tensors are all of a `KEPT` type;
    the others are absent (they stay float)."""
    from gguf import GGUFReader
    try:
        tensors = {t.name: t for t in GGUFReader(str(path)).tensors}
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot read GGUF file {path}: {e}") from None
    groups = {f"model.layers.{i}.{ours}": [(f"blk.{i}.{name}.weight", name) for name in names]
              for i in range(cfg.num_layers) for ours, names in _LAYER_LINEARS.items()}
    head = "token_embd.weight" if cfg.tie_word_embeddings and "output.weight" not in tensors else "output.weight"
    groups["lm_head"] = [(head, "output")]
    out: dict[str, QuantWeight] = {}
    for ours, parts in groups.items():
        found = [(tensors.get(key), name) for key, name in parts]
        if all(t is not None and t.tensor_type.name in KEPT and len(t.shape) == 2 for t, _ in found):
            kinds = {KEPT[t.tensor_type.name] for t, _ in found}
            kind = kinds.pop() if len(kinds) == 1 else "q8_0"  # mixed: the widest
            out[ours] = _concat([_weight(t, name, cfg, kind) for t, name in found])
    return out


def _weight(t, name: str, cfg: ModelConfig, kind: str) -> QuantWeight:
    """A GGUF tensor [n, k] of a `KEPT` type as `kind`, in our row order."""
    k, n = (int(v) for v in t.shape)  # GGUF lists the innermost dimension first
    w = repack(t.tensor_type.name, np.asarray(t.data), n, k, kind)
    if cfg.arch == "llama" and name in ("attn_q", "attn_k"):
        heads = cfg.num_heads if name == "attn_q" else cfg.num_kv_heads
        w = quant.permute_rows(w, _unpermute_order(n, heads))
    return w


def repack(qtype: str, raw: np.ndarray, n: int, k: int, kind: str | None = None) -> QuantWeight:
    """A GGUF tensor's raw blocks (uint8, n rows of type `qtype`, a `KEPT` type) as `kind`
    (default `KEPT[qtype]`): in its own form where `kind` is that, else (q8_0) re-quantized
    from gguf-py's dequantized values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    kind = kind or KEPT[qtype]
    if qtype in quant.GGUF_KINDS and quant.GGUF_KINDS[qtype][0] == kind:
        return quant.from_gguf(qtype, raw, n, k)
    if qtype == "Q4_K" and kind == "q4_1":
        return _q4_k(raw, n, k)
    values = dequantize(np.asarray(raw, dtype=np.uint8), GGMLQuantizationType[qtype]).reshape(n, k)
    return quant.quantize(torch.from_numpy(values), kind)


def _q4_k(raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """A Q4_K tensor [n, k] as q4_1. A super-block of 256 values is, per 32-value
    sub-block j, (d sc_j) q - (dmin m_j) with q in 0..15 and sc_j, m_j 6-bit: q4_1's
    d' q + m' with d' = d sc_j and m' = -(dmin m_j). The codes are the file's; d' and m'
    are stored in float16 (d sc_j needs up to 17 significant bits), each within a relative
    2^-11 of its value (2^-25 absolute below float16's normal range, 6.1e-5), so a weight
    is within 2^-11 (q |d sc_j| + |dmin m_j|) of gguf-py's dequantize -- the one departure
    from it."""
    from gguf.quants import Q4_K
    blocks = np.array(raw, dtype=np.uint8).reshape(-1, Q4_K_BYTES)  # [n * k / 256, 144]
    d = blocks[:, 0:2].view(np.float16).astype(np.float32)  # [b, 1]
    dmin = blocks[:, 2:4].view(np.float16).astype(np.float32)
    sc, mins = Q4_K.get_scale_min(blocks[:, 4:16])  # [b, 8] each
    # each 32 bytes of codes: sub-block 2i in the low nibbles, 2i + 1 in the high
    qs = blocks[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    codes = torch.from_numpy((qs & 15).reshape(n, k))
    scale = torch.from_numpy((d * sc).reshape(n, k // quant.GROUP))  # exact in float32
    minimum = torch.from_numpy(-(dmin * mins).reshape(n, k // quant.GROUP))
    return quant.pack("q4_1", codes, scale.to(torch.float16), minimum.to(torch.float16))


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
