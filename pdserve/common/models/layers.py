"""Building blocks shared by the supported architectures, numerically matching
transformers' implementations (float32 norm statistics, rotate-half RoPE)."""
from __future__ import annotations

import torch
from torch import nn

from pdserve import kernels


class Linear(nn.Linear):
    """nn.Linear whose product goes through a `kernels.LinearPlan` (CPU float32: the native
    GEMM on a packed copy of the weight; the same result up to float rounding order). The
    plan is made on first use and again whenever the weight or the bias has been written
    since, or `quant` set.

    `quant`: a weight-only int8 / int4 form of the weight (`kernels.quant.QuantWeight`,
    set once loaded: `common.models.quantization`), which the plan multiplies by instead of
    `weight`. Every assignment of any Linear's `quant` counts in `Linear.quant_epoch`, so
    that whoever reads many linears' plans (the native decode stack) sees a change in one
    read instead of one per linear."""

    _plan: kernels.LinearPlan | None = None
    _plan_of: tuple[int, ...] | None = None
    _quant = None  # kernels.quant.QuantWeight | None
    quant_epoch = 0  # assignments of `quant`, every Linear's

    @property
    def quant(self):
        return self._quant

    @quant.setter
    def quant(self, value) -> None:
        self._quant = value
        Linear.quant_epoch += 1

    def _key(self) -> tuple[int, ...]:
        """What a plan is made of: the weight's and the bias's storage and version (a swap or
        an in-place write changes one), and `quant`. Read from `_parameters` directly:
        nn.Module's attribute lookup costs ~1 us."""
        params = self._parameters
        w, b = params["weight"], params["bias"]
        key = (w.data_ptr(), w._version, id(self.quant))
        return key if b is None else key + (b.data_ptr(), b._version)

    def plan(self) -> kernels.LinearPlan:
        """The plan for the weight and bias as they are now."""
        key = self._key()
        if self._plan_of != key:
            b = self.bias
            self._plan = kernels.LinearPlan(self.weight.detach(), None if b is None else b.detach(), self.quant)
            self._plan_of = key
        return self._plan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.plan()(x)


class RMSNorm(nn.Module):
    """Owns the scale vector; normalizes in float32 like transformers. Called with a
    residual it is the pre-norm residual step: returns (norm(x + residual), x + residual),
    fused into one pass on the CPU (`kernels.add_rms_norm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None and x.dim() != 2:
            return kernels.reference.rms_norm(x, self.weight, self.eps)
        out, res = kernels.add_rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, res)


class RotaryEmbedding(nn.Module):
    """Owns cos/sin tables for positions [0, max_positions); rotate-half layout.
    `attention_scaling` (YaRN) multiplies both tables, as transformers does.

    `tables(positions)` looks up one step's rows once for every layer; `apply` rotates
    with them. The sine table's first half is stored negated, so that rotate_half(x) * sin
    = cat(-x2, x1) * sin is computed as roll(x) * sin_signed: the same products, bit for
    bit, in one op fewer."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0) -> None:
        super().__init__()
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, D]
        sin = emb.sin() * attention_scaling
        half = sin.shape[-1] // 2
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin_signed", torch.cat((-sin[:, :half], sin[:, half:]), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, signed sin), each [N, 1, D] in `dtype`."""
        return (self.cos[positions].unsqueeze(1).to(dtype), self.sin_signed[positions].unsqueeze(1).to(dtype))

    @staticmethod
    def apply(x: torch.Tensor, tables: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [N, H, D] rotated: x * cos + rotate_half(x) * sin, as transformers computes it."""
        cos, sin_signed = tables
        return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * sin_signed

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N]; q [N, Hq, D], k [N, Hkv, D]."""
        t = self.tables(positions, q.dtype)
        return self.apply(q, t), self.apply(k, t)


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj.plan().silu_mul(x))
