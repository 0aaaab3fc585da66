"""A decode step's decoder layers in one native call on CPU (kernels/csrc/decode_layers_cpu.c).

On the CPU there is no graph to capture, and at a few sequences a decoder layer's Python
dispatch (a dozen torch ops and ctypes calls, each a few microseconds) costs more than
its arithmetic, at every layer of every step. `DecodeStack` holds
every layer's weight and cache pointers, set up once, and runs all layers of a pure
decode batch in one call, through the native kernels the per-op path calls one by one
(the same results up to float rounding in the q/k norm and rotary step).

`DecodeStack.build` returns None where it does not apply (not CPU float32 activations,
norms, float32, bf16 or weight-only int8 / int4 packed weights, a float32 or bf16 KV cache, the native
library unavailable or turned off with ``PDSERVE_CPU_ATTENTION=torch``, a weight without
unit stride along its input); the caller keeps the per-op path then.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from . import cpu_native, quant

_POINTERS = ("input_norm", "post_norm", "qkv_p", "qkv_b", "q_norm", "k_norm", "o_p", "gate_up_p", "down_p",
             "k_cache", "v_cache")
_STRIDES = ("k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh")
_KINDS = ("qkv_kind", "o_kind", "gate_up_kind", "down_kind")  # each matrix's PD_W_*
# what a packed matrix of each kind holds: float32 or bf16 [panels, k, 16] panels, or
# kernels.quant's uint8 blocks [panels, k / 32 * block_bytes]
_KIND_DTYPES = {0: torch.float32, 1: torch.bfloat16, **{c: torch.uint8 for c in quant.KIND_CODES.values()}}


class _LayerStruct(ctypes.Structure):
    """pd_layer_t in decode_layers_cpu.c, field for field."""

    _fields_ = ([(name, ctypes.c_void_p) for name in _POINTERS] + [(name, ctypes.c_int64) for name in _STRIDES]
                + [(name, ctypes.c_int64) for name in _KINDS] + [("kv_bf16", ctypes.c_int64)])


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's tensors as the native stack reads them. Matrices are
    nn.Linear's [out, in] weights packed by `cpu_native.pack_weight` (float32, or bf16
    widened in registers) or `kernels.quant` (int8 / int4), of the kinds `kinds` gives
    (qkv, o, gate_up, down: `kernels.LinearPlan.kind`); caches float32 or bf16; the rest
    float32. qkv_b, q_norm and k_norm may be None (q_norm and k_norm together); caches are
    [num_blocks, block_size, Hkv, D]."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_p: torch.Tensor | None  # None where a linear was not packed: no stack then
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_p: torch.Tensor | None
    gate_up_p: torch.Tensor | None
    down_p: torch.Tensor | None
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    kinds: tuple[int, int, int, int] = (0, 0, 0, 0)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.input_norm, self.post_norm, self.qkv_p, self.qkv_b, self.q_norm, self.k_norm,
                            self.o_p, self.gate_up_p, self.down_p) if t is not None]


@dataclass(frozen=True)
class StackDims:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    norm_eps: float
    qk_eps: float
    scale: float


def _panels(n: int) -> int:
    return -(-n // cpu_native.PANEL)


def _packed_shape(kind: int, n: int, k: int) -> tuple[int, ...]:
    """The packed form's shape of an [n, k] weight of this kind."""
    if kind in (0, 1):
        return (_panels(n), k, cpu_native.PANEL)
    name = next(name for name, code in quant.KIND_CODES.items() if code == kind)
    return (_panels(n), k // quant.GROUP * quant.block_bytes(name))


def _eligible(layer: LayerTensors, d: StackDims) -> bool:
    nqkv = (d.num_heads + 2 * d.num_kv_heads) * d.head_dim
    sized = [(layer.input_norm, d.hidden), (layer.post_norm, d.hidden), (layer.qkv_b, nqkv),
             (layer.q_norm, d.head_dim), (layer.k_norm, d.head_dim)]
    vec = [t for t, _ in sized if t is not None]
    if any(t is not None and tuple(t.shape) != (n,) for t, n in sized):
        return False  # the native code reads exactly these lengths
    if any(kind not in _KIND_DTYPES for kind in layer.kinds):
        return False
    dims = ((nqkv, d.hidden), (d.hidden, d.num_heads * d.head_dim), (2 * d.intermediate, d.hidden),
            (d.hidden, d.intermediate))
    if any(kind > 1 and k % quant.GROUP for kind, (_, k) in zip(layer.kinds, dims)):
        return False
    mats = [(m, _packed_shape(kind, n, k)) for m, kind, (n, k)
            in zip((layer.qkv_p, layer.o_p, layer.gate_up_p, layer.down_p), layer.kinds, dims)]
    caches = (layer.k_cache, layer.v_cache)
    if (layer.q_norm is None) != (layer.k_norm is None) or any(m is None for m, _ in mats):
        return False
    for t in vec:
        if t.device.type != "cpu" or t.dtype != torch.float32:
            return False
    if (any(c.device.type != "cpu" or c.dtype != caches[0].dtype for c in caches)
            or caches[0].dtype not in cpu_native.KV_DTYPES):
        return False
    if any(m.dtype != _KIND_DTYPES[kind] or m.device.type != "cpu" for (m, _), kind in zip(mats, layer.kinds)):
        return False
    return (all(v.is_contiguous() for v in vec)
            and all(tuple(m.shape) == shape and m.is_contiguous() for m, shape in mats)
            and all(c.dim() == 4 and tuple(c.shape[2:]) == (d.num_kv_heads, d.head_dim) and c.stride(3) == 1
                    for c in caches)
            and layer.k_cache.shape[:2] == layer.v_cache.shape[:2])


class DecodeStack:
    """Every layer's pointers, set up once: a call runs them all for a decode batch."""

    def __init__(self, layers: list[LayerTensors], dims: StackDims) -> None:
        self.layers, self.dims = layers, dims
        self._fn = cpu_native.library().pd_decode_layers
        self._structs = (_LayerStruct * len(layers))()
        for s, layer in zip(self._structs, layers):
            for name in _POINTERS:
                t = getattr(layer, name)
                setattr(s, name, 0 if t is None else t.data_ptr())
            s.k_sb, s.k_st, s.k_sh = layer.k_cache.stride()[:3]
            s.v_sb, s.v_st, s.v_sh = layer.v_cache.stride()[:3]
            for name, kind in zip(_KINDS, layer.kinds):
                setattr(s, name, kind)
            s.kv_bf16 = int(layer.k_cache.dtype == torch.bfloat16)
        self.num_blocks, self.block_size = layers[0].k_cache.shape[:2] if layers else (0, 1)

    @classmethod
    def build(cls, layers: list[LayerTensors], dims: StackDims) -> DecodeStack | None:
        """The stack, or None where the native path does not apply to these tensors."""
        if (not layers or not cpu_native.enabled() or cpu_native.library() is None
                or dims.head_dim % 2 or not all(_eligible(layer, dims) for layer in layers)
                or len({tuple(layer.k_cache.shape[:2]) for layer in layers}) != 1):
            return None
        return cls(layers, dims)

    @staticmethod
    def takes(x: torch.Tensor) -> bool:
        """Whether a batch of these embedded rows fits: CPU float32, and the native
        kernels not turned off."""
        return (x.dim() == 2 and 0 < x.shape[0] and x.dtype == torch.float32
                and x.device.type == "cpu" and cpu_native.enabled())

    def __call__(self, h: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h [m, hidden] embeddings (overwritten); slots [m]; tables [m, max_blocks];
        lens [m]; cos, sin [m, head_dim] (sin's first half negated) -> (h, residual): the
        last layer's MLP output and the residual stream, for the final norm."""
        d = self.dims
        m = h.shape[0]
        h = h.contiguous()
        residual = torch.empty_like(h)
        slots = slots.to(torch.int64).contiguous()
        tables = tables.to(torch.int32).contiguous()
        lens = lens.to(torch.int32).contiguous()
        cos, sin = cos.to(torch.float32).contiguous(), sin.to(torch.float32).contiguous()
        if not (slots.shape == lens.shape == (m,) and tables.dim() == 2 and tables.shape[0] == m
                and cos.shape == sin.shape == (m, d.head_dim)):
            raise ValueError("DecodeStack: slots, tables, lens, cos and sin must have one row per token")
        status = self._fn(ctypes.addressof(self._structs), len(self.layers), m, d.hidden, d.num_heads, d.num_kv_heads,
                          d.head_dim, d.intermediate, self.block_size, self.num_blocks, d.norm_eps, d.qk_eps, d.scale,
                          h.data_ptr(), residual.data_ptr(), slots.data_ptr(), tables.data_ptr(), lens.data_ptr(),
                          tables.shape[1], cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
        if status:
            raise cpu_native.NativeKernelError(
                f"native decode layers: {cpu_native.ERRORS.get(status, f'error {status}')}")
        return h, residual
