"""Which dtype each part of the model is held and computed in, from the engine's dtype.

On the CPU, `bfloat16` means bf16 *weights* and float32 *arithmetic*: the linears' weights
and the embedding table (the lm_head's too, where tied) are held in bf16, and the native
GEMM widens them to float32 in registers (kernels/csrc/gemm_cpu.c), so a decode step
streams half the bytes; everything else -- activations, the residual stream, RMSNorm and
its weights, rotary tables, attention, biases, logits -- stays float32. Why: a CPU without
AVX512_BF16 has no bf16 arithmetic (torch's bf16 ops widen, compute and round back at
every op, ~3x slower than our float32), decode is bound by the weight stream, which the
bf16 weights halve, and every activation rounded to bf16 would only lose accuracy (the
norms' statistics, the residual sum and softmax are where bf16 hurts most). The KV cache
is bf16 too (`kv_cache_dtype`): K and V are rounded to nearest even as they are stored and
widened in registers as attention reads them (kernels/csrc), half the bytes that decode
attention streams, and twice the tokens in the same memory. On a GPU, and for float16,
the whole model is cast to the dtype as before.
"""
from __future__ import annotations

import torch
from torch import nn

from pdserve.common.config import DeviceConfig
from pdserve.common.models.layers import Linear


def storage_only(device: DeviceConfig) -> bool:
    """Whether the engine's dtype is for storage alone (weights and KV cache), the
    arithmetic float32: bf16 on the CPU."""
    return device.device == "cpu" and device.torch_dtype == torch.bfloat16


def activation_dtype(device: DeviceConfig) -> torch.dtype:
    """The dtype activations and the residual stream are computed in."""
    return torch.float32 if storage_only(device) else device.torch_dtype


def kv_cache_dtype(device: DeviceConfig) -> torch.dtype:
    """The KV cache's dtype (what P and D must agree on): the engine's dtype."""
    return device.torch_dtype


def cast_model(model: nn.Module, device: DeviceConfig) -> nn.Module:
    """The model on its device in the dtypes above (in place where torch's `to` is)."""
    model = model.to(device=torch.device(device.device), dtype=activation_dtype(device))
    if storage_only(device):
        # each Linear's weight and the embedding table; a tied lm_head shares the table's
        # Parameter, so it is narrowed once and stays tied
        params = {id(p): p for m in model.modules() if isinstance(m, (Linear, nn.Embedding)) for p in [m.weight]}
        for p in params.values():
            p.data = p.data.to(torch.bfloat16)  # round to nearest even
    return model
