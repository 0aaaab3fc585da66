"""`--dtype auto`: the engine dtype a checkpoint asks for, as vLLM picks it.

config.json's `dtype` (transformers 5) or `torch_dtype` (4) is the dtype the weights were
saved in. auto follows it: bfloat16 -> bfloat16, float32 -> float32 (a float32 checkpoint
is never narrowed behind the user's back), none given -> float32 (vLLM's default too).
float16 -> float16 on a GPU; on the CPU bfloat16, as vLLM's CPU backend does: the CPU has
no float16 arithmetic (torch widens it op by op, ~3x slower than our float32), while
bfloat16 there means bf16 weights through the native GEMM with float32 activations
(common.models.precision), so the only loss is the weights' three lowest mantissa bits,
and the weight stream is half of float32's.
"""
from __future__ import annotations

from pathlib import Path

from pdserve.common.config_base import ConfigError, dtype_name, read_json

AUTO = "auto"


def stored_dtype(model_dir: str | Path) -> str | None:
    """The checkpoint's dtype from config.json (`dtype`, else `torch_dtype`), or None."""
    cfg = read_json(Path(model_dir) / "config.json")
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    if value is None:
        return None
    try:
        return dtype_name(value)
    except ConfigError:
        raise ConfigError(f"{model_dir}/config.json: dtype {value!r} is not supported") from None


def resolve_dtype(requested: str, model_dir: str | Path, device: str) -> str:
    """The engine dtype for `requested` (a dtype name, or "auto") on `device`."""
    if requested != AUTO:
        return dtype_name(requested)
    stored = stored_dtype(model_dir) or "float32"
    if stored == "float16" and device == "cpu":
        return "bfloat16"
    return stored
