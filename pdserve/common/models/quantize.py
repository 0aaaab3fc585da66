"""Setting a model's linears to weight-only int8 / int4 (common/quantization.py says which
and why): from their float weights, or from weights already quantized (a GGUF file's)."""
from __future__ import annotations

from torch import nn

from pdserve.common.models.layers import Linear
from pdserve.kernels import quant
from pdserve.kernels.quant import QuantWeight

LM_HEAD_KIND = "q8_0"  # the lm_head at most int8, under int4 too


def quantize_linears(model: nn.Module, quantization: str) -> int:
    """int8 / int4: every Linear's `quant` from its weight (the lm_head int8); returns how
    many. A Linear whose inputs are not whole groups of 32 stays float."""
    kind = quant.FROM_FLOAT[quantization]
    weights = {name: quant.quantize(module.weight, LM_HEAD_KIND if name == "lm_head" else kind)
               for name, module in model.named_modules()
               if isinstance(module, Linear) and module.in_features % quant.GROUP == 0}
    set_quantized(model, weights)
    return len(weights)


def set_quantized(model: nn.Module, weights: dict[str, QuantWeight]) -> None:
    """Each named Linear's `quant` from `weights` (module name -> weight of its shape), the
    blocks copied into one buffer in the modules' order (`quant.in_one_buffer`). Its
    float weight is let go (the plan dequantizes `quant` where it needs floats), unless an
    embedding table shares it (a tied lm_head: the lookups read it)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    names = [name for name, _ in model.named_modules() if name in weights]  # the order a forward pass reads them
    for name in weights:
        module, w = model.get_submodule(name), weights[name]
        if not isinstance(module, Linear) or (w.n, w.k) != (module.out_features, module.in_features):
            raise ValueError(f"quantized weight [{w.n}, {w.k}] does not fit {name}")
    for name, w in zip(names, quant.in_one_buffer([weights[name] for name in names])):
        module = model.get_submodule(name)
        module.quant = w
        if id(module.weight) not in tables:
            module.weight.data = module.weight.data.new_empty((0, module.in_features))
