"""KV-cache kernels for pdserve: Triton (GPU) versions and pure-torch references.

Public API (dispatchers; Triton on CUDA tensors when triton is usable, else torch)::

    store_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out
    gather_blocks(cache, block_ids) -> buf
    scatter_blocks(cache, block_ids, buf) -> None
    LinearPlan(weight, bias)(x) -> y       # CPU: a packed copy of the weight, native GEMM
    LinearPlan([gate; up]).silu_mul(x) -> silu(x gate^T) * (x up^T)  # fused on CPU
    add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)   # fused on CPU
    qk_norm_rope_(qkv, ...) -> bool       # q/k heads normed and rotated in place (CPU)
    silu_mul(gate_up) -> silu(gate) * up                              # fused on CPU

Explicit flavors: ``kernels.reference.<fn>`` and ``kernels.triton_<fn>``. The
Triton flavors also run on CPU tensors when ``TRITON_INTERPRET=1`` is set before
their first call (used by the tests).

Importing this package has no side effects and does not import triton; the Triton
modules (``kv_store``, ``paged_attention``, ``block_copy``) are imported on first use.
Set ``PDSERVE_DISABLE_TRITON=1`` to force the torch references everywhere.

This package is ``pdserve.kernels``: a top-level ``kernels`` is Hugging Face's hub
library (which transformers >= 5.25 imports), never this one.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib.util
import os

import torch

from . import reference

__all__ = [
    "reference",
    "store_kv",
    "paged_decode_attention",
    "LinearPlan",
    "decode_rows",
    "add_rms_norm",
    "qk_norm_rope_",
    "silu_mul",
    "gather_blocks",
    "scatter_blocks",
    "triton_store_kv",
    "triton_paged_decode_attention",
    "triton_gather_blocks",
    "triton_scatter_blocks",
    "triton_available",
    "use_triton",
]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True if the ``triton`` package can be found (does not import it)."""
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether the dispatchers send a call with tensor ``t`` to the Triton flavor."""
    return (
        t.is_cuda
        and triton_available()
        and os.environ.get("PDSERVE_DISABLE_TRITON", "0") in ("", "0")
    )


# --------------------------------------------------------------------------- #
# Triton flavors (lazy import of the triton modules)
# --------------------------------------------------------------------------- #


def triton_store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64/int32, -1 = skip
) -> None:
    """Triton :func:`store_kv` (see :mod:`kernels.kv_store`)."""
    from .kv_store import store_kv as impl

    impl(key, value, k_cache, v_cache, slot_mapping)


def triton_paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Triton :func:`paged_decode_attention` (see :mod:`kernels.paged_attention`)."""
    from .paged_attention import paged_decode_attention as impl

    return impl(q, k_cache, v_cache, block_tables, context_lens, scale)


def triton_gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D]
    """Triton :func:`gather_blocks` (see :mod:`kernels.block_copy`)."""
    from .block_copy import gather_blocks as impl

    return impl(cache, block_ids)


def triton_scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Triton :func:`scatter_blocks` (see :mod:`kernels.block_copy`)."""
    from .block_copy import scatter_blocks as impl

    impl(cache, block_ids, buf)


# --------------------------------------------------------------------------- #
# Dispatchers
# --------------------------------------------------------------------------- #


def store_kv(
    key: torch.Tensor,  # [N, Hkv, D]
    value: torch.Tensor,  # [N, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # [N] int64/int32, -1 = skip
) -> None:
    """Write key/value rows into the paged caches at ``slot_mapping`` (in place)."""
    if use_triton(k_cache):
        triton_store_kv(key, value, k_cache, v_cache, slot_mapping)
    elif key.device.type == "cpu" and _cpu_native().supports_store_kv(key, value, k_cache, v_cache):
        _cpu_native().store_kv(key, value, k_cache, v_cache, slot_mapping)
    else:
        reference.store_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D], q.dtype
    """Decode attention (one query token per sequence) over paged KV."""
    if use_triton(q):
        return triton_paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    if q.device.type == "cpu":
        from . import cpu_attention, cpu_native
        if cpu_native.supports(q, k_cache, v_cache):
            return cpu_native.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
        return cpu_attention.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
    return reference.paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm residual step: h = x + residual (x when residual is None), returned
    with RMSNorm(h) * weight (float32 statistics, as transformers). Fused on CPU float32."""
    if x.dim() == 2 and x.device.type == "cpu":
        native = _cpu_native()
        if native.supports_rows(x, *(() if residual is None else (residual,))):
            return native.add_rms_norm(x, residual, weight, eps)
    h = x if residual is None else x + residual
    return reference.rms_norm(h, weight, eps), h


def qk_norm_rope_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The fused q/k/v projection's q and k heads, in place: RMS-normed (Qwen3, when the
    norms are given) and rotated by the rows' rope tables cos / sin [N, D] (sin's first
    half negated). One native pass on CPU float32; returns False, touching nothing, where
    that does not apply (the caller runs its torch ops then)."""
    if (qkv.dim() != 2 or qkv.device.type != "cpu" or qkv.stride(1) != 1 or head_dim % 2 or head_dim > 4096
            or not _cpu_native().supports_rows(qkv) or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or any(t is not None and t.dtype != torch.float32 for t in (q_norm, k_norm))):
        return False
    _cpu_native().qk_norm_rope_(qkv, num_heads, num_kv_heads, head_dim, q_norm, k_norm, eps, cos, sin)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: gate_up [rows, 2 * dim] -> silu(gate) * up. Fused on CPU float32."""
    if gate_up.dim() == 2 and gate_up.device.type == "cpu" and _cpu_native().supports_rows(gate_up):
        return _cpu_native().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


# Whether every row the linears multiply now is a decode token (`decode_rows`)
_DECODE_ROWS = contextvars.ContextVar("pdserve_decode_rows", default=False)


@contextlib.contextmanager
def decode_rows(on: bool = True):
    """Within: every row a `LinearPlan` multiplies is a decode token (a pure decode step),
    so a quantized weight multiplies by int8 dot products at any row count, as the native
    decode stack does (kernels/csrc/decode_layers_cpu.c). Outside, rows past
    `quant.QDOT_ROWS` (prompt chunks) take the float32 tile on the dequantized weight, so
    that prompt logits are float32's on the dequantized weights exactly."""
    token = _DECODE_ROWS.set(on)
    try:
        yield
    finally:
        _DECODE_ROWS.reset(token)


# A bf16 weight's product over at least this many prompt rows goes through torch's bf16
# matmul where the CPU has bf16 dot-product hardware (`bf16_dot_cpu`)
BF16_DOT_ROWS = 32


def bf16_dot_cpu() -> bool:
    """Whether torch's bf16 matmul runs on bf16 dot-product hardware here -- AMX tiles or
    AVX512_BF16, as torch.cpu reports them -- where oneDNN multiplies a prompt chunk's bf16
    rows several times faster than the native tile's float32 arithmetic over widened bf16
    weights (an AMX Xeon, 2 threads, 2048^3: 631-1447 against 169 GFLOP/s). Not under
    `--emulate-avx2` (PDSERVE_EMULATE_AVX2=1) or an AVX2 kernel build; PDSERVE_CPU_BF16_DOT=1
    or 0 says yes or no whatever the CPU."""
    forced = os.environ.get("PDSERVE_CPU_BF16_DOT", "").strip()
    if forced in ("0", "1"):
        return forced == "1"
    if os.environ.get("PDSERVE_EMULATE_AVX2") == "1" or "-mno-avx512f" in os.environ.get("PDSERVE_KERNEL_CFLAGS", ""):
        return False
    return _bf16_dot_hardware()


@functools.lru_cache(maxsize=None)
def _bf16_dot_hardware() -> bool:
    cpu = torch.cpu
    return any(bool(getattr(cpu, probe, lambda: False)()) for probe in ("_is_amx_tile_supported",
                                                                      "_is_avx512_bf16_supported"))


class LinearPlan:
    """One weight (and bias) made ready for `F.linear`'s job once, so that a call costs one
    native call and no re-checking. On CPU float32 the weight is packed into panels of 16
    output columns (`kernels.cpu_native.pack_weight`) for the native GEMM
    (kernels/csrc/gemm_cpu.c), which beats MKL and oneDNN at every row count a decode
    batch or a prefill chunk has here; without the native library, oneDNN on its own
    packed copy (``PDSERVE_CPU_LINEAR=torch``: plain `F.linear`). Either packed copy is a
    second copy of the weight in memory. A bf16 weight on the CPU is packed in bf16 and
    multiplies float32 activations into float32 (widened in registers: half the bytes
    streamed); where the CPU has bf16 dot products (`bf16_dot_cpu`), BF16_DOT_ROWS rows
    or more outside a pure decode step (`decode_rows`: a prompt chunk, and the decode rows
    that share its step) are instead rounded to bf16 and multiplied by torch's bf16 matmul
    (oneDNN: AMX or AVX512_BF16) on the weight as stored, the product widened to float32
    -- vLLM's CPU arithmetic in bf16, which compute-bound prefill rows gain from and
    decode rows (bound by the weight stream) do not; off the native path its product is
    `F.linear` on the weight widened to the activations' dtype. A plan is for the weight as
    it is now: re-plan after writing it (`common.models.layers.Linear` does, by the
    weight's version).

    `quant` (a `kernels.quant.QuantWeight`): the weight is that weight-only int8 / int4 one
    instead, multiplied natively (`kind` says which: PD_W_* of kernels/csrc/gemm_tile.h;
    `quant.gemm_q`: int8 dot products for a decode batch, the float32 tile on dequantized
    slices for more rows); off the native path, `F.linear` on it
    dequantized to float32 (`weight` may be empty then: it is not read)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, quant=None) -> None:
        self.weight, self.bias, self.quant = weight, bias, quant
        self.packed: torch.Tensor | None = None  # native layout, when `native`
        self.native = False
        self.kind = 0  # PD_W_F32
        self._onednn: torch.Tensor | None = None
        self._bf16_dot = False  # prompt chunks through torch's bf16 matmul (bf16_dot_cpu)
        native = _cpu_native()
        cpu = (weight.device.type == "cpu" and weight.dim() == 2 and (bias is None or bias.dtype == torch.float32)
               and os.environ.get("PDSERVE_CPU_LINEAR", "").strip().lower() != "torch")
        cpu_f32 = cpu and weight.dtype == torch.float32
        usable = native.enabled() and native.library() is not None
        self._n, self._k = (quant.n, quant.k) if quant is not None else weight.shape
        self._b = None if bias is None else bias.contiguous()
        self._bp = 0 if self._b is None else self._b.data_ptr()
        if quant is not None:
            from .quant import dequantize
            self.weight = None  # made from quant on first use off the native path
            self._dequantize = lambda: dequantize(quant).to(weight.device)
            if cpu and usable:
                self.native, self.packed, self.kind = True, quant.data, quant.code
                self._fn, self._qdot = native.library().pd_gemm_q, native.library().pd_gemm_qdot
        elif cpu and weight.dtype in native.PACKED_DTYPES and usable:
            self.native = True
            self.packed = native.pack_weight(weight)  # in the weight's own dtype
            self.kind = int(self.packed.dtype == torch.bfloat16)  # PD_W_BF16
            self._bf16_dot = self.kind == 1 and bf16_dot_cpu()
            lib = native.library()
            self._fn = lib.pd_gemm_bf16 if self.kind else lib.pd_gemm
        elif cpu_f32 and torch.backends.mkldnn.is_available():
            self._onednn = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native and x.dim() == 2 and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == self._k
                and x.device.type == "cpu"):
            m, n = x.shape[0], self._n
            if self._takes_bf16_dot(m):
                return self._bf16_matmul(x)
            y = torch.empty((m, n), dtype=torch.float32)
            args = (x.data_ptr(), x.stride(0), m, self._k, self.packed.data_ptr())
            if self.kind > 1:  # quantized: int8 dot products for decode rows (any count) and short chunks
                fn = self._qdot if _DECODE_ROWS.get() else self._fn
                status = m and fn(*args, self.kind, self._bp, y.data_ptr(), n, n, torch.get_num_threads())
            else:
                status = m and self._fn(*args, self._bp, y.data_ptr(), n, n, torch.get_num_threads())
            if status:
                raise _cpu_native().NativeKernelError("native gemm: bad arguments")
            return y
        if self._onednn is not None and x.dim() == 2 and x.dtype == torch.float32 and x.device.type == "cpu":
            return torch.ops.mkldnn._linear_pointwise(x, self._onednn, self.bias, "none", [], "")
        if self.weight is None:  # a quantized weight, off the native path
            self.weight = self._dequantize()
        if x.dtype != self.weight.dtype:  # bf16 weights, float32 activations, off the native path
            bias = None if self.bias is None else self.bias.to(x.dtype)
            return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def _takes_bf16_dot(self, rows: int) -> bool:
        """Whether these rows go through torch's bf16 matmul (`_bf16_matmul`)."""
        return self._bf16_dot and rows >= BF16_DOT_ROWS and not _DECODE_ROWS.get()

    def _bf16_matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x rounded to bf16 @ the bf16 weight^T by torch (oneDNN), widened to float32, + bias."""
        y = torch.nn.functional.linear(x.to(torch.bfloat16), self.weight).float()
        return y if self._b is None else y.add_(self._b)

    def silu_mul(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of `self(x)`, for a weight [gate; up] (SwiGLU's fused gate and up
        projections, no bias): on the native path, where the halves are whole panels, in
        one pass that never writes the [rows, 2 * dim] product out (the same bits as
        `silu_mul(self(x))`); else those two steps."""
        inter = self._n // 2 if self.native else 0
        if (self.native and self._b is None and self._n % (2 * _cpu_native().PANEL) == 0 and x.dim() == 2
                and x.dtype == torch.float32 and x.stride(1) == 1 and x.shape[1] == self._k and x.device.type == "cpu"
                and not self._takes_bf16_dot(x.shape[0])):
            if self.kind > 1:
                from .quant import gemm_silu_q
                return gemm_silu_q(x, self.quant, dequant=False if _DECODE_ROWS.get() else None)
            return _cpu_native().gemm_silu(x, self.packed, inter)
        return silu_mul(self(x))


# The row count oneDNN picks its packed layout for (its fallback path only).
ONEDNN_ROWS_HINT = 64


@functools.lru_cache(maxsize=None)
def _cpu_native():
    from . import cpu_native
    return cpu_native


def gather_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
) -> torch.Tensor:  # [n, block_size, Hkv, D], contiguous
    """Copy the given cache blocks into a new contiguous buffer."""
    if use_triton(cache) and cache.is_contiguous():
        return triton_gather_blocks(cache, block_ids)
    return reference.gather_blocks(cache, block_ids)


def scatter_blocks(
    cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] (or any [num_blocks, ...])
    block_ids: torch.Tensor,  # [n] int64
    buf: torch.Tensor,  # [n, block_size, Hkv, D]
) -> None:
    """Write ``buf[i]`` into ``cache[block_ids[i]]`` (in place)."""
    if use_triton(cache) and cache.is_contiguous():
        triton_scatter_blocks(cache, block_ids, buf)
    else:
        reference.scatter_blocks(cache, block_ids, buf)
