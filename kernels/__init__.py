"""KV-cache kernels for pdserve: Triton (GPU) versions and pure-torch references.

Public API (dispatchers; Triton on CUDA tensors when triton is usable, else torch)::

    store_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale) -> out
    gather_blocks(cache, block_ids) -> buf
    scatter_blocks(cache, block_ids, buf) -> None
    paged_prefill_attention(...)   # torch reference only
    linear(x, weight, bias, packed) -> y   # CPU: native kernel up to 8 rows, oneDNN
    pack_linear_weight(weight) -> packed   # on a pre-packed weight for more; else F.linear
    add_rms_norm(x, residual, weight, eps) -> (normed, x + residual)   # fused on CPU
    silu_mul(gate_up) -> silu(gate) * up                              # fused on CPU

Explicit flavors: ``kernels.reference.<fn>`` and ``kernels.triton_<fn>``. The
Triton flavors also run on CPU tensors when ``TRITON_INTERPRET=1`` is set before
their first call (used by the tests).

Importing this package has no side effects and does not import triton; the Triton
modules (``kv_store``, ``paged_attention``, ``block_copy``) are imported on first use.
Set ``PDSERVE_DISABLE_TRITON=1`` to force the torch references everywhere.

NOTE: transformers probes for a package named ``kernels`` (the HF hub library) and
may import this one. Do not define ``__version__`` here or add names of that
library's API, or transformers may mistake this package for it.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

from . import reference

__all__ = [
    "reference",
    "store_kv",
    "paged_decode_attention",
    "paged_prefill_attention",
    "linear",
    "pack_linear_weight",
    "LinearPlan",
    "add_rms_norm",
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


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for x [m, k]. On CPU float32: up to ``SMALL_LINEAR_MAX_ROWS`` (8) rows,
    a decode batch, the native kernel, which reads ``weight`` at memory speed where MKL
    does not; more rows with ``packed`` (from :func:`pack_linear_weight`) oneDNN on the
    pre-packed weight, which MKL does not match below a few hundred rows."""
    if x.device.type == "cpu" and x.dim() == 2:
        native = _cpu_native()
        if x.shape[0] <= native.SMALL_LINEAR_MAX_ROWS and native.supports_linear(x, weight):
            return native.small_linear(x, weight, bias)
        if packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.nn.functional.linear(x, weight, bias)


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


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: gate_up [rows, 2 * dim] -> silu(gate) * up. Fused on CPU float32."""
    if gate_up.dim() == 2 and gate_up.device.type == "cpu" and _cpu_native().supports_rows(gate_up):
        return _cpu_native().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


class LinearPlan:
    """One weight (and bias) made ready for :func:`linear`'s CPU paths once, so a call
    with a decode batch costs one native call and no re-checking: the native kernel's
    eligibility (CPU float32, unit stride along k, built, enabled) and oneDNN's packed
    copy are settled here. A plan is for the weight as it is now: re-plan after writing
    it (`common.models.layers.Linear` does, by the weight's version)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        self.weight, self.bias = weight, bias
        self.packed = pack_linear_weight(weight)
        native = _cpu_native()
        self.native = (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
                       and weight.stride(1) == 1 and native.enabled() and native.library() is not None
                       and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous())))
        if self.native:
            self._fn = native.library().pd_small_linear
            self._n, self._k = weight.shape
            self._w, self._ldw = weight.data_ptr(), weight.stride(0)
            self._b = 0 if bias is None else bias.data_ptr()
        self._max_rows = native.SMALL_LINEAR_MAX_ROWS

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if (self.native and x.dim() == 2 and x.shape[0] <= self._max_rows and x.dtype == torch.float32
                and x.stride(1) == 1 and x.shape[1] == self._k and x.device.type == "cpu"):
            m, n = x.shape[0], self._n
            y = torch.empty((m, n), dtype=torch.float32)
            if self._fn(x.data_ptr(), self._w, self._b, y.data_ptr(), m, n, self._k, x.stride(0), self._ldw, n,
                        torch.get_num_threads()):
                raise _cpu_native().NativeKernelError("native small linear: bad arguments")
            return y
        return linear(x, self.weight, self.bias, self.packed)


# The row count oneDNN picks its packed layout for; the layout serves any row count
# (measured best overall for decode batches of 8-64 and prefill chunks).
PACK_ROWS_HINT = 64


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` [n, k] reordered into oneDNN's blocked layout for :func:`linear`, or None
    where that does not apply (not CPU float32, no oneDNN, or ``PDSERVE_CPU_LINEAR=torch``).
    The packed copy is a second copy of the weight in memory."""
    if (weight.device.type != "cpu" or weight.dtype != torch.float32 or weight.dim() != 2
            or not torch.backends.mkldnn.is_available()
            or os.environ.get("PDSERVE_CPU_LINEAR", "").strip().lower() == "torch"):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS_HINT)


@functools.lru_cache(maxsize=None)
def _cpu_native():
    from . import cpu_native
    return cpu_native


def paged_prefill_attention(
    q: torch.Tensor,  # [Ntok, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    cu_seqlens_q: torch.Tensor,  # [B + 1]
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [Ntok, Hq, D]
    """Causal (chunked) prefill attention over paged KV (torch reference on all devices)."""
    return reference.paged_prefill_attention(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale
    )


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
