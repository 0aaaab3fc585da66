"""RoPE settings read from config.json, in both spellings transformers writes:
transformers 4 (`rope_theta` + `rope_scaling`) and transformers 5 (`rope_parameters`).

Precedence mirrors transformers' `convert_rope_params_to_dict` / `standardize_rope_params`,
so the same folder means the same frequencies to both of us."""
from __future__ import annotations

from dataclasses import dataclass

from pdserve.common.config_base import ConfigError

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3")
_REQUIRED = {"linear": ("factor",), "dynamic": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor")}


@dataclass(frozen=True)
class RopeConfig:
    """How rotary frequencies are derived: base `theta` plus one scaling scheme."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float | None = None
    # llama3
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    original_max_position_embeddings: int | None = None
    # yarn
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


def _num(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"config.json {field} must be a number, got {value!r}")
    return float(value)


def parse_rope(cfg: dict) -> RopeConfig:
    """The RoPE settings of one config.json dict; ConfigError names an unsupported field."""
    params = cfg.get("rope_parameters")
    scaling = cfg.get("rope_scaling")
    # transformers lets `rope_scaling` (the older spelling) override `rope_parameters`
    where, raw = ("rope_scaling", scaling) if scaling else ("rope_parameters", params)
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config.json {where} must be an object, got {raw!r}")
    if any(isinstance(v, dict) for v in raw.values()):
        raise ConfigError(f"config.json {where} holds per-layer-type RoPE settings, which are not supported")
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ConfigError(f"config.json {where}.rope_type {rope_type!r} is not supported "
                          f"(supported: {', '.join(ROPE_TYPES)})")
    theta = raw.get("rope_theta", cfg.get("rope_theta", 10000.0))
    partial = raw.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and _num("partial_rotary_factor", partial) != 1.0:
        raise ConfigError(f"config.json partial_rotary_factor {partial!r} is not supported (only 1.0)")
    for key in _REQUIRED.get(rope_type, ()):
        if raw.get(key) is None:
            raise ConfigError(f"config.json {where} with rope_type {rope_type!r} needs {key!r}")
    original = None
    if rope_type in ("llama3", "yarn"):
        # a top-level original_max_position_embeddings wins (Phi-3 style), as in transformers
        original = cfg.get("original_max_position_embeddings",
                           raw.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048)))
        original = int(_num(f"{where}.original_max_position_embeddings", original))
    opt = lambda key: None if raw.get(key) is None else _num(f"{where}.{key}", raw[key])  # noqa: E731
    return RopeConfig(
        theta=_num("rope_theta", theta), rope_type=rope_type, factor=opt("factor"),
        low_freq_factor=opt("low_freq_factor"), high_freq_factor=opt("high_freq_factor"),
        original_max_position_embeddings=original, attention_factor=opt("attention_factor"),
        beta_fast=opt("beta_fast"), beta_slow=opt("beta_slow"), mscale=opt("mscale"),
        mscale_all_dim=opt("mscale_all_dim"), truncate=bool(raw.get("truncate", True)))
