"""A decode step's decoder layers in one native call on CPU (kernels/csrc/decode_layers_cpu.c).

On the CPU there is no graph to capture, and at a few sequences a decoder layer's Python
dispatch (a dozen torch ops and ctypes calls, each a few microseconds) costs more than
its arithmetic, at every layer of every step. `DecodeStack` holds
every layer's weight and cache pointers, set up once, and runs a pure decode batch from
its token ids to the final norm in one call (on to the logits and each row's argmax with
`DecodeStack.logits`): the embedding lookup, all layers, the final norm (and the lm_head),
through the native kernels the per-op path calls one by one (the same
results up to float rounding in the q/k norm and rotary step). In a real step each op
left in Python costs tens of microseconds, not a few: the weights streamed through the
caches have evicted the interpreter's code and data.

A batch of as many rows as the crossover of one of its linears (`kernels.crossover`: from
there on torch's bf16 matmul beats the native tile on bf16 hardware) is not the stack's:
`DecodeStack.takes_rows` says so, and the caller runs the per-op path, where each linear
picks its own product.

`DecodeStack.build` returns None where it does not apply (not CPU float32 activations,
norms, float32, bf16 or weight-only int8 / int4 packed weights, a float32 or bf16 KV cache
and embedding table, float32 rotary tables, the native library unavailable or turned off
with ``PDSERVE_CPU_ATTENTION=torch``, a weight without unit stride along its input); the
caller keeps the per-op path then.
"""
from __future__ import annotations

import ctypes
from array import array
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from . import cpu_native, crossover, quant

_POINTERS = ("input_norm", "post_norm", "qkv_p", "qkv_b", "q_norm", "k_norm", "o_p", "gate_up_p", "down_p",
             "k_cache", "v_cache")
_STRIDES = ("k_sb", "k_st", "k_sh", "v_sb", "v_st", "v_sh")
_KINDS = ("qkv_kind", "o_kind", "gate_up_kind", "down_kind")  # each matrix's PD_W_*
# what a packed matrix of each kind holds: float32 or bf16 [panels, k, 16] panels, or
# kernels.quant's uint8 blocks [panels, k / 32 * block_bytes]
_ERRORS = {1: "bad arguments (a token id or position outside its table, a context longer than its block table, "
              "or a slot or block id outside the cache)", 2: "out of memory"}
_KIND_DTYPES = {0: torch.float32, 1: torch.bfloat16, **{c: torch.uint8 for c in quant.KIND_CODES.values()}}
# The parts of a step `DecodeStack.parts` times (decode_layers_cpu.c's PD_PART_*, in order),
# then the calls' whole time and their count: benchmarks/decode/parts.py
PARTS = ("embed", "norms", "qkv", "rope_store", "attention", "o", "gate_up", "down", "lm_head", "argmax")
PART_TOTAL, PART_CALLS = len(PARTS), len(PARTS) + 1


class DecodeInputs(NamedTuple):
    """One decode step's rows as `DecodeStack.logits` reads them: plain arrays, no
    tensors. A decode step's Python runs between two streams of every weight through the
    caches, each object it touches cold; a torch tensor made or read there costs tens of
    microseconds, an array a fraction of one. ids, positions, slots: array('q') [m];
    tables: array('i') [m * width], each row's block ids padded with -1; lens: array('i') [m]."""

    ids: array
    positions: array
    slots: array
    tables: array
    width: int
    lens: array

    @classmethod
    def of(cls, ids: list[int], positions: list[int], block_tables: list[list[int]],
           block_size: int) -> DecodeInputs:
        """Rows of one token each: token ids, positions, and each row's block table; the
        slot and context length follow from the position."""
        width = max(map(len, block_tables))
        tables = array("i")
        for t in block_tables:
            tables.extend(t)
            tables.extend([-1] * (width - len(t)))
        slots = [t[p // block_size] * block_size + p % block_size for t, p in zip(block_tables, positions)]
        return cls(array("q", ids), array("q", positions), array("q", slots), tables, width,
                   array("i", [p + 1 for p in positions]))


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
class ModelTensors:
    """What the layers take from the model around them: the embedding table [vocab,
    hidden] (float32 or bf16), the rotary tables cos and sin_signed [max_positions,
    head_dim] float32 (sin's first half negated: `common.models.layers.RotaryEmbedding`)
    and the final norm's weight [hidden] float32; and the lm_head, where the stack is to
    compute logits too: its [head_n, hidden] weight packed as a layer's matrices, of kind
    `head_kind`, and its bias [head_n] float32 or None."""

    embed: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    final_norm: torch.Tensor
    head_p: torch.Tensor | None = None
    head_b: torch.Tensor | None = None
    head_n: int = 0
    head_kind: int = 0

    def tensors(self) -> list[torch.Tensor]:
        return [self.embed, self.cos, self.sin, self.final_norm]


class _ModelStruct(ctypes.Structure):
    """pd_model_t in decode_layers_cpu.c, field for field."""

    _fields_ = [("embed", ctypes.c_void_p), ("vocab", ctypes.c_int64), ("embed_bf16", ctypes.c_int64),
                ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p), ("max_positions", ctypes.c_int64),
                ("final_norm", ctypes.c_void_p), ("head", ctypes.c_void_p), ("head_b", ctypes.c_void_p),
                ("head_n", ctypes.c_int64), ("head_kind", ctypes.c_int64)]


def _model_fits(model: ModelTensors, d: "StackDims") -> bool:
    rows = model.cos.shape[0] if model.cos.dim() == 2 else -1
    return (all(t.device.type == "cpu" and t.is_contiguous() for t in model.tensors())
            and model.embed.dim() == 2 and model.embed.shape[1] == d.hidden
            and model.embed.dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == torch.float32 and tuple(t.shape) == (rows, d.head_dim) for t in (model.cos, model.sin))
            and model.final_norm.dtype == torch.float32 and tuple(model.final_norm.shape) == (d.hidden,))


def _head_fits(model: ModelTensors, d: "StackDims") -> bool:
    """Whether the lm_head is one the stack can multiply by (as `_eligible` a layer's matrices)."""
    p, b, kind = model.head_p, model.head_b, model.head_kind
    if p is None or kind not in _KIND_DTYPES or model.head_n <= 0 or (kind > 1 and d.hidden % quant.GROUP):
        return False
    return (p.device.type == "cpu" and p.dtype == _KIND_DTYPES[kind] and p.is_contiguous()
            and tuple(p.shape) == _packed_shape(kind, model.head_n, d.hidden)
            and (b is None or (b.device.type == "cpu" and b.dtype == torch.float32 and b.is_contiguous()
                               and tuple(b.shape) == (model.head_n,))))


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


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


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
    """Every layer's pointers, set up once: a call runs them all for a decode batch.

    `layer_rows` / `head_rows`: the fewest rows at which a layer's linear / the lm_head
    would take another product than the stack's (`kernels.LinearPlan.bf16_rows`; NEVER:
    none), so that batches of that many rows are left to the per-op path (`takes_rows`)."""

    def __init__(self, layers: list[LayerTensors], dims: StackDims, model: ModelTensors,
                 layer_rows: int = crossover.NEVER, head_rows: int = crossover.NEVER) -> None:
        if not _head_fits(model, dims):
            model = replace(model, head_p=None, head_b=None, head_n=0, head_kind=0)
        self.layers, self.dims, self.model = layers, dims, model
        self.has_head = model.head_p is not None  # `logits` applies
        self.layer_rows, self.head_rows = layer_rows, min(layer_rows, head_rows)
        # float64 [len(PARTS) + 2] or None: each call adds its seconds by part, its whole
        # time and 1 (at PART_TOTAL, PART_CALLS); None, the default, times nothing
        self.parts: torch.Tensor | None = None
        self._fn = cpu_native.library().pd_decode_layers
        self._bufs: tuple[int, torch.Tensor, torch.Tensor, array] | None = None  # `logits`' outputs: (m, ...)
        self._model = _ModelStruct(model.embed.data_ptr(), model.embed.shape[0],
                                   int(model.embed.dtype == torch.bfloat16), model.cos.data_ptr(),
                                   model.sin.data_ptr(), model.cos.shape[0], model.final_norm.data_ptr(),
                                   _ptr(model.head_p), _ptr(model.head_b), model.head_n, model.head_kind)
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
    def build(cls, layers: list[LayerTensors], dims: StackDims, model: ModelTensors,
              layer_rows: int = crossover.NEVER, head_rows: int = crossover.NEVER) -> DecodeStack | None:
        """The stack, or None where the native path does not apply to these tensors (a
        stack without logits, `has_head` False, where only the lm_head does not)."""
        if (not layers or not cpu_native.enabled() or cpu_native.library() is None
                or dims.head_dim % 2 or not all(_eligible(layer, dims) for layer in layers)
                or len({tuple(layer.k_cache.shape[:2]) for layer in layers}) != 1 or not _model_fits(model, dims)):
            return None
        return cls(layers, dims, model, layer_rows, head_rows)

    def takes_rows(self, m: int, head: bool = False) -> bool:
        """Whether a batch of m rows is the stack's: fewer than the crossover of every linear
        it would multiply by (its layers', and the lm_head's with `head`: `logits`)."""
        return m < (self.head_rows if head else self.layer_rows)

    @staticmethod
    def takes(ids: torch.Tensor) -> bool:
        """Whether a batch of these token ids fits: CPU int64 [m], m > 0, and the native
        kernels not turned off."""
        return (ids.dim() == 1 and 0 < ids.shape[0] and ids.dtype == torch.int64 and ids.device.type == "cpu"
                and cpu_native.enabled())

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                 lens: torch.Tensor) -> torch.Tensor:
        """ids, positions, slots [m] int64; tables [m, max_blocks] int32; lens [m] int32
        -> the final norm's output [m, hidden] float32. A token id or position outside
        its table raises NativeKernelError (nothing stored then)."""
        d = self.dims
        m = ids.shape[0]
        args = [ids, positions, slots, tables, lens]
        for i, (t, dtype) in enumerate(zip(args, (torch.int64, torch.int64, torch.int64, torch.int32, torch.int32))):
            if t.dtype is not dtype or not t.is_contiguous():  # what the runner gives needs no copy
                args[i] = t.to(dtype).contiguous()
        ids, positions, slots, tables, lens = args
        if not (ids.shape == positions.shape == slots.shape == lens.shape == (m,) and tables.dim() == 2
                and tables.shape[0] == m):
            raise ValueError("DecodeStack: ids, positions, slots, tables and lens must have one row per token")
        out = torch.empty((m, d.hidden), dtype=torch.float32)
        self._call(m, ids.data_ptr(), positions.data_ptr(), out.data_ptr(), slots.data_ptr(), tables.data_ptr(),
                   lens.data_ptr(), tables.shape[1], None, None)
        return out

    def logits(self, rows: DecodeInputs) -> tuple[torch.Tensor, list[int]]:
        """The rows through every layer on to the lm_head in one call (where `has_head`):
        (logits [m, head_n] float32, each row's argmax as torch.argmax gives it). The
        logits are the stack's own buffer, written again by its next call of as many rows:
        what a decode step samples from, allocated once per batch size. A token id,
        position, slot or block id outside its table raises NativeKernelError."""
        if not self.has_head:
            raise ValueError("DecodeStack.logits: this stack was set up without an lm_head")
        m = len(rows.ids)
        if not (m > 0 and len(rows.positions) == len(rows.slots) == len(rows.lens) == m and rows.width > 0
                and len(rows.tables) == m * rows.width and rows.ids.typecode == rows.positions.typecode
                == rows.slots.typecode == "q" and rows.tables.typecode == rows.lens.typecode == "i"):
            raise ValueError("DecodeStack.logits: ids, positions, slots and lens of one row per token ('q', 'q', "
                             "'q', 'i'), tables of width per row ('i')")
        bufs = self._bufs
        if bufs is None or bufs[0] != m:
            bufs = self._bufs = (m, torch.empty((m, self.dims.hidden), dtype=torch.float32),
                                 torch.empty((m, self.model.head_n), dtype=torch.float32), array("q", bytes(8 * m)))
        _, out, logits, top = bufs
        self._call(m, rows.ids.buffer_info()[0], rows.positions.buffer_info()[0], out.data_ptr(),
                   rows.slots.buffer_info()[0], rows.tables.buffer_info()[0], rows.lens.buffer_info()[0], rows.width,
                   logits.data_ptr(), top.buffer_info()[0])
        return logits, top.tolist()

    def _parts_ptr(self) -> int | None:
        parts = self.parts
        if parts is None:
            return None
        if not (parts.dtype == torch.float64 and parts.device.type == "cpu" and parts.is_contiguous()
                and tuple(parts.shape) == (len(PARTS) + 2,)):
            raise ValueError(f"DecodeStack.parts must be a contiguous CPU float64 tensor of {len(PARTS) + 2}")
        return parts.data_ptr()

    def _call(self, m: int, ids: int, positions: int, out: int, slots: int, tables: int, lens: int, width: int,
              logits: int | None, top: int | None) -> None:
        """pd_decode_layers on these addresses (logits and top: None to stop at the final norm)."""
        d = self.dims
        status = self._fn(ctypes.addressof(self._structs), len(self.layers), m, d.hidden, d.num_heads, d.num_kv_heads,
                          d.head_dim, d.intermediate, self.block_size, self.num_blocks, d.norm_eps, d.qk_eps, d.scale,
                          ctypes.addressof(self._model), ids, positions, out, slots, tables, lens, width,
                          torch.get_num_threads(), logits, top, self._parts_ptr())
        if status:
            raise cpu_native.NativeKernelError(f"native decode layers: {_ERRORS.get(status, f'error {status}')}")
