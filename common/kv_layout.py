"""The KV layout of an engine (what a P and a D must agree on before KV can move between
them) and the model fingerprint in it. An engine property, so it lives in `common/`; the
transfer handshake (kv_transfer) and the router's registration check both use it."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from common.config import EngineConfig
from common.messages import KVLayout

_CHUNK = 1 << 20  # bytes hashed from each end of a weight file


def model_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits identifying a model directory's config and weights.

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
    return h.hexdigest()


def layout_of(config: EngineConfig) -> KVLayout:
    m = config.model
    return KVLayout(model_fingerprint=model_fingerprint(m.model_dir), dtype=config.device.dtype,
                    block_size=config.cache.block_size, num_layers=m.num_layers,
                    num_kv_heads=m.num_kv_heads, head_dim=m.head_dim)


def layout_mismatch(ours: KVLayout, theirs: KVLayout) -> str | None:
    """A readable description of every field where two layouts differ, or None."""
    diffs = [f"{name}: prefill has {getattr(ours, name)!r}, decode has {getattr(theirs, name)!r}"
             for name in ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
             if getattr(ours, name) != getattr(theirs, name)]
    return "; ".join(diffs) if diffs else None
