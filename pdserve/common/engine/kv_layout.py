"""The KV layout of an engine (what a P and a D must agree on before KV can move between
them) and the model fingerprint in it, and the KV cache tensor's memory order. An engine
property, so it lives in `common/`; the transfer handshake (kv_transfer) and the router's
registration check both use it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.common.checkpoint_dtype import dtype_name
from pdserve.common.config import EngineConfig
from pdserve.common.quantization import precision
from pdserve.common.wire.messages import KVLayout

if TYPE_CHECKING:  # the router checks fingerprints without torch: only kv_cache_tensor imports it
    import torch

_CHUNK = 1 << 20  # bytes hashed from each end of a weight file


def model_fingerprint(model_dir: str | Path, dtype: str = "float32", quantization: str = "none") -> str:
    """What a model computes with: 16 hex digits identifying a model directory's config
    and weights, then ":" and the engine dtype it runs in, with its weight quantization
    when it has one ("3f...9a:bfloat16", "3f...9a:float32+int4"), so that a bfloat16 or int4
    worker cannot join a float32 deployment (its logits and KV differ). Readable apart:
    `fingerprint_parts`.

    config.json in full, and of each *.safetensors file its name, size, head (header and
    first tensors) and tail: cheap for big checkpoints, and different whenever the weights
    differ in practice."""
    model_dir = Path(model_dir)
    h = hashlib.blake2b((model_dir / "config.json").read_bytes(), digest_size=8)
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        with open(path, "rb") as f:
            h.update(json.dumps([path.name, size]).encode())
            h.update(f.read(_CHUNK))
            f.seek(max(0, size - _CHUNK))
            h.update(f.read(_CHUNK))
    return f"{h.hexdigest()}:{precision(dtype_name(dtype), quantization)}"


def fingerprint_parts(fingerprint: str) -> tuple[str, str]:
    """(weights digest, precision: the dtype[+quantization]) of a `model_fingerprint` ("" for a part it lacks)."""
    digest, _, dtype = fingerprint.partition(":")
    return digest, dtype


def layout_of(config: EngineConfig) -> KVLayout:
    m = config.model
    fingerprint = model_fingerprint(m.model_dir, config.device.dtype, config.device.quantization)
    return KVLayout(model_fingerprint=fingerprint, dtype=config.device.dtype,
                    block_size=config.cache.block_size, num_layers=m.num_layers,
                    num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


def layout_mismatch(ours: KVLayout, theirs: KVLayout) -> str | None:
    """A readable description of every field where two layouts differ, or None."""
    diffs = [f"{name}: prefill has {getattr(ours, name)!r}, decode has {getattr(theirs, name)!r}"
             for name in ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
             if getattr(ours, name) != getattr(theirs, name)]
    return "; ".join(diffs) if diffs else None


def kv_cache_tensor(shape: tuple[int, ...], dtype: "torch.dtype", device: "str | torch.device",
                    storage: "torch.Tensor | None" = None) -> "torch.Tensor":
    """The KV cache `shape` = [2, layers, num_blocks, block_size, kv_heads, head_dim],
    the order every reader indexes it by. On the CPU each block is laid out head-major in
    memory ([kv_heads, block_size, head_dim]; the tensor is a transposed view of it): decode
    attention then reads a head's keys of a block as one run instead of 256-byte pieces a
    token row apart, which the hardware prefetcher follows (vLLM's CPU cache does the same).
    Whole-block copies (transfers) do not care; indexing code must not `.view` it.
    `storage`: a flat tensor of exactly the right size to lay it in (shared memory; both
    sides of a mapping build their view here, so they agree), taken as it is; else the
    cache is allocated, zeroed (on huge pages on the CPU)."""
    import torch

    from pdserve.kernels import huge_pages
    two, layers, blocks, block_size, heads, head_dim = shape
    cpu = torch.device(device).type == "cpu"
    physical = (two, layers, blocks, heads, block_size, head_dim) if cpu else shape
    if storage is not None:
        cache = storage.view(physical)
    elif cpu:
        cache = huge_pages.zeros(physical, dtype)
    else:
        cache = torch.zeros(physical, dtype=dtype, device=device)
    return cache.transpose(3, 4) if cpu else cache
