"""Weight-only int8 / int4 weights in the packed layout the native kernels read
(kernels/csrc/gemm_quant_cpu.c, whose header draws the layout): integer dot products with
int8 activations for decode-sized products, the float32 tile on dequantized slices for
larger ones.

Three kinds, each GGUF's own block math with a float16 scale per 32 values along k:
    q8_0  int8 q                  w = d * q          (`--quantization int8`; GGUF Q8_0)
    q4_0  int4 q in 0..15         w = d * (q - 8)    (GGUF Q4_0)
    q4_1  int4 q in 0..15         w = d * q + m      (`--quantization int4`; GGUF Q4_1)
`quantize` makes them from float weights; `from_gguf` repacks a GGUF tensor's raw blocks as
they are (no dequantize and re-quantize: the same weights bit for bit); `dequantize` is
the float32 weight the kernel computes with, as gguf-py dequantizes. `gemm_q`,
`gemm_silu_q` and `quantize_rows` call the native products (kernels.cpu_native's library)."""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import numpy as np
import torch

from . import cpu_native, huge_pages

GROUP = 32  # k values per scale (PD_QGROUP)
PANEL = 16  # output columns per panel (PD_NR)
KIND_CODES = {"q8_0": 2, "q4_0": 3, "q4_1": 4}  # PD_W_* of kernels/csrc/gemm_tile.h
# what --quantization names make from float weights
FROM_FLOAT = {"int8": "q8_0", "int4": "q4_1"}


def block_bytes(kind: str) -> int:
    """Bytes of one group of one panel: scales, (mins,) data."""
    data = GROUP * PANEL if kind == "q8_0" else GROUP * PANEL // 2
    return (4 if kind == "q4_1" else 2) * PANEL + data


@dataclass(frozen=True, eq=False)
class QuantWeight:
    """A [n, k] weight packed for the native GEMM: `data` [ceil(n / 16), k / 32 * block_bytes]
    uint8, panel by panel."""

    kind: str
    n: int
    k: int
    data: torch.Tensor

    @property
    def code(self) -> int:
        return KIND_CODES[self.kind]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _check(kind: str, n: int, k: int) -> None:
    if kind not in KIND_CODES:
        raise ValueError(f"quantized kind {kind!r} is not one of {sorted(KIND_CODES)}")
    if k % GROUP or n <= 0:
        raise ValueError(f"a [{n}, {k}] weight cannot be quantized in groups of {GROUP} along its {k} inputs")


def pack(kind: str, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None = None) -> QuantWeight:
    """q [n, k] integer codes (q8_0: -128..127; q4: 0..15), d (and for q4_1 m) [n, k / 32]
    float16 -> the packed weight (columns past n: zero scales, zero codes)."""
    n, k = q.shape
    _check(kind, n, k)
    g = k // GROUP
    if d.shape != (n, g) or (kind == "q4_1") != (m is not None) or (m is not None and m.shape != (n, g)):
        raise ValueError(f"pack: scales {tuple(d.shape)} (mins {None if m is None else tuple(m.shape)}) "
                         f"do not fit a {kind} weight [{n}, {k}]")
    pad = -n % PANEL
    panels = (n + pad) // PANEL

    def panel_major(t: torch.Tensor) -> torch.Tensor:  # [n, g, ...] -> [panels, g, ..., 16]
        t = torch.cat((t, t.new_zeros(pad, *t.shape[1:]))) if pad else t
        t = t.reshape(panels, PANEL, *t.shape[1:])
        return t.movedim(1, -1)

    head = [panel_major(d.to(torch.float16)).contiguous().view(torch.uint8)]  # [panels, g, 32]
    if m is not None:
        head.append(panel_major(m.to(torch.float16)).contiguous().view(torch.uint8))
    codes = panel_major(q.reshape(n, g, GROUP))  # [panels, g, 32 rows, 16 columns]
    # [panels, g, quad t, half h, column c, row j]: rows 4 t + j of column 8 h + c
    codes = codes.reshape(panels, g, GROUP // 4, 4, 2, PANEL // 2).permute(0, 1, 2, 4, 5, 3)
    if kind == "q8_0":
        body = codes.to(torch.int8).contiguous().view(torch.uint8).reshape(panels, g, -1)
    else:
        c = codes.to(torch.uint8)
        body = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(panels, g, -1)  # half 0 low, half 1 high nibble
    blocks = torch.cat((*head, body), dim=-1).reshape(panels, -1)
    out = huge_pages.empty(tuple(blocks.shape), torch.uint8)  # streamed every decode step
    out.copy_(blocks)
    return QuantWeight(kind, n, k, out)


def unpack(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(q [n, k], d [n, k / 32] float16, m or None): `pack`'s inverse."""
    g, hdr = w.k // GROUP, (4 if w.kind == "q4_1" else 2) * PANEL
    blocks = w.data.reshape(w.data.shape[0], g, -1)

    def row_major(t: torch.Tensor) -> torch.Tensor:  # [panels, g, ..., 16] -> [n, g, ...]
        return t.movedim(-1, 1).reshape(-1, *t.shape[1:-1])[:w.n]

    d = row_major(blocks[..., :2 * PANEL].contiguous().view(torch.float16))
    m = row_major(blocks[..., 2 * PANEL:4 * PANEL].contiguous().view(torch.float16)) if w.kind == "q4_1" else None
    body = blocks[..., hdr:]
    quads = (*body.shape[:2], GROUP // 4)
    if w.kind == "q8_0":
        codes = body.contiguous().view(torch.int8).reshape(*quads, 2, PANEL // 2, 4)
    else:
        b = body.reshape(*quads, 1, PANEL // 2, 4)
        codes = torch.cat((b & 15, b >> 4), dim=3)
    codes = codes.permute(0, 1, 2, 5, 3, 4).reshape(*body.shape[:2], GROUP, PANEL)  # [.., 32 rows, 16 columns]
    return row_major(codes).reshape(w.n, w.k), d, m


def dequantize(w: QuantWeight) -> torch.Tensor:
    """The float32 [n, k] weight the kernel computes with (gguf-py's arithmetic)."""
    q, d, m = unpack(w)
    d = d.float().repeat_interleave(GROUP, dim=1)
    if w.kind == "q8_0":
        return q.float() * d
    if w.kind == "q4_0":
        return (q.to(torch.int8) - 8).float() * d
    return q.float() * d + m.float().repeat_interleave(GROUP, dim=1)


def quantize(weight: torch.Tensor, kind: str) -> QuantWeight:
    """A float weight [n, k] as q8_0 (symmetric, d = max |w| / 127) or q4_1 (d = (max -
    min) / 15, m = min), per group of 32 along k; each code rounded against the float16
    scale it is stored with."""
    n, k = weight.shape
    _check(kind, n, k)
    w = weight.detach().float().reshape(n, k // GROUP, GROUP)
    if kind == "q8_0":
        d = (w.abs().amax(-1) / 127).to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1 / d.float())
        q = torch.round(w * inv.unsqueeze(-1)).clamp(-127, 127)
        return pack(kind, q.reshape(n, k).to(torch.int8), d)
    if kind == "q4_1":
        lo, hi = w.amin(-1), w.amax(-1)
        d, m = ((hi - lo) / 15).to(torch.float16), lo.to(torch.float16)
        inv = torch.where(d == 0, 0.0, 1 / d.float())
        q = torch.round((w - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15)
        return pack(kind, q.reshape(n, k).to(torch.uint8), d, m)
    raise ValueError(f"quantize: no quantizer from float for {kind!r} (use {sorted(FROM_FLOAT.values())})")


# GGUF block forms (ggml-common.h) that are our kinds: the kind, and bytes per 32 values
GGUF_KINDS = {"Q8_0": ("q8_0", 34), "Q4_0": ("q4_0", 18), "Q4_1": ("q4_1", 20)}


def from_gguf(type_name: str, raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """A GGUF tensor's raw blocks (uint8, n rows of k / 32 blocks; type Q8_0, Q4_0 or Q4_1)
    repacked as they are."""
    kind, size = GGUF_KINDS[type_name]
    _check(kind, n, k)
    g = k // GROUP
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8).reshape(n, g, size))  # a copy: the file is mapped read-only
    d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, g)
    if kind == "q8_0":
        return pack(kind, blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k), d)
    m = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, g) if kind == "q4_1" else None
    qs = blocks[..., 4 if m is not None else 2:]  # byte j: value j low nibble, value j + 16 high
    codes = torch.cat((qs & 15, qs >> 4), dim=-1).reshape(n, k)
    return pack(kind, codes, d, m)


def permute_rows(w: QuantWeight, order: torch.Tensor) -> QuantWeight:
    """w with its output rows taken in `order` (llama's q/k rows un-permuted)."""
    q, d, m = unpack(w)
    return pack(w.kind, q[order], d[order], None if m is None else m[order])


def in_one_buffer(weights: list[QuantWeight]) -> list[QuantWeight]:
    """The same weights, their blocks copied one after another into one buffer on huge
    pages (`huge_pages`). A decode step streams a model's matrices in this order; each
    alone is under one 2 MB page (a 135M model's largest int8 matrix is 1.9 MB), so apart
    they sit on 4 KB pages, where the prefetcher stops at every page edge and the stream
    takes a TLB entry per 4 KB."""
    total = sum(w.nbytes for w in weights)
    buf = huge_pages.empty((total,), torch.uint8)
    out, start = [], 0
    for w in weights:
        data = buf[start:start + w.nbytes].view(w.data.shape)
        data.copy_(w.data)
        out.append(QuantWeight(w.kind, w.n, w.k, data))
        start += w.nbytes
    return out


# Rows of x up to which gemm_q multiplies by int8 dot products (PD_QDOT_ROWS, gemm_tile.h).
QDOT_ROWS = 8


def _quant_fn(lib: ctypes.CDLL, name: str, dequant: bool | None):
    return getattr(lib, name + {None: "", True: "_dequant", False: "dot"}[dequant])


def gemm_q(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, dequant: bool | None = None
           ) -> torch.Tensor:
    """x [m, k] @ w^T (+ bias [n]) -> [m, n] float32, w a weight-only quantized weight
    (kernels/csrc/qdot_cpu.c and gemm_quant_cpu.c). Up to QDOT_ROWS rows (a decode
    batch; any with dequant=False) by int8 dot products with x quantized per 32 values
    (`quantize_rows`); more (any with dequant=True) by the float32 tile on the weight
    dequantized slice by slice, the same bits as `gemm` on `quant.dequantize(w)` packed
    in float32."""
    lib, x = cpu_native.library_and_rows(x)
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"gemm_q: x [{m}, {k}] does not fit a weight [{w.n}, {w.k}]")
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    y = torch.empty((m, w.n), dtype=torch.float32)
    fn = _quant_fn(lib, "pd_gemm_q", dequant)
    if fn(x.data_ptr(), x.stride(0), m, k, w.data.data_ptr(), w.code, 0 if bias is None else bias.data_ptr(),
          y.data_ptr(), w.n, w.n, torch.get_num_threads()):
        raise cpu_native.NativeKernelError("native gemm_q: bad arguments")
    return y


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [m, k] float32 (k a multiple of 32) as gemm_q's int8 dot products quantize it: per
    32 values int8 codes [m, k], scale [m, k / 32] float32 and code sum [m, k / 32] int32."""
    lib, x = cpu_native.library_and_rows(x)
    m, k = x.shape
    q = torch.empty((m, k), dtype=torch.int8)
    d = torch.empty((m, k // 32), dtype=torch.float32)
    s = torch.empty((m, k // 32), dtype=torch.int32)
    if x.dtype != torch.float32 or lib.pd_quantize_rows_q8(x.data_ptr(), x.stride(0), m, k, q.data_ptr(), d.data_ptr(),
                                                           s.data_ptr()):
        raise ValueError(f"quantize_rows: x {tuple(x.shape)} {x.dtype} is not float32 in whole groups of 32")
    return q, d, s


def gemm_silu_q(x: torch.Tensor, w: QuantWeight, dequant: bool | None = None) -> torch.Tensor:
    """`gemm_silu` on a quantized [gate; up] weight (w.n / 2 a multiple of cpu_native.PANEL), its
    products as `gemm_q`'s."""
    lib, x = cpu_native.library_and_rows(x)
    m, k = x.shape
    inter = w.n // 2
    if k != w.k or w.n % (2 * cpu_native.PANEL):
        raise ValueError(f"gemm_silu_q: x [{m}, {k}] and a weight [{w.n}, {w.k}] do not fit")
    act = torch.empty((m, inter), dtype=torch.float32)
    fn = _quant_fn(lib, "pd_gemm_silu_q", dequant)
    if fn(x.data_ptr(), x.stride(0), m, k, w.data.data_ptr(), w.code, act.data_ptr(), inter, inter,
          torch.get_num_threads()):
        raise cpu_native.NativeKernelError("native gemm_silu_q: bad arguments")
    return act
