"""Rotary frequencies per RoPE type, computed as transformers' `modeling_rope_utils` does
(same formulas, same float32 order of operations) so greedy output stays token-exact."""
from __future__ import annotations

import math

import torch

from pdserve.common.rope_config import RopeConfig


def rope_frequencies(head_dim: int, max_position_embeddings: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention scaling applied to cos and sin)."""
    base, dim = rope.theta, head_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "dynamic":
        # NTK-by-parts recomputes theta once a sequence outgrows max_position_embeddings;
        # pdserve never runs past it (EngineConfig caps max_model_len), and below it
        # transformers uses seq_len = max_position_embeddings, i.e. this formula at ratio 1.
        seq_len = max_position_embeddings
        base = base * ((rope.factor * seq_len / max_position_embeddings) - (rope.factor - 1)) ** (dim / (dim - 2))
        return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.rope_type == "yarn":
        return _yarn(dim, max_position_embeddings, rope)
    raise ValueError(f"unknown rope type {rope.rope_type!r}")  # parse_rope refuses these first


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_len = rope.original_max_position_embeddings
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    # long wavelengths are divided by factor, short ones kept, the middle band interpolated
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(dim: int, max_position_embeddings: int, rope: RopeConfig) -> tuple[torch.Tensor, float]:
    base, original = rope.theta, rope.original_max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original

    def get_mscale(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(get_mscale(factor, rope.mscale) / get_mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp  # share of each frequency kept unscaled
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor
