"""The native CPU decode attention (kernels/csrc/paged_decode_attention_cpu.c), built on
first use with the system C compiler and called through ctypes.

It reads K/V blocks where they lie in the paged cache: no gather copy, one read of each
K and V row per step, the query heads of a GQA group sharing each read. That is why it
beats `kernels.cpu_attention` (index_select + SDPA), which copies the context first.

Build: `$CC` (default `cc`) with `-O3 -march=native -ffast-math` and then any flags in
`$PDSERVE_KERNEL_CFLAGS` (say `-mno-avx512f`, for the AVX2 code on an AVX-512 machine), into
`$PDSERVE_CACHE/kernels` (default `~/.cache/pdserve/kernels`) under a name that hashes
the source, the flags, the compiler and the CPU model, so a stale or foreign build is
never loaded. Concurrent builders (several workers starting at once) each write a temp
file and rename it into place. No compiler, or a failed build: `library()` returns None
once with a warning and the dispatcher keeps the torch path. `PDSERVE_CPU_ATTENTION=torch`
turns the native kernel off.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
from pathlib import Path
import torch

from . import huge_pages
from .atomic_file import replaced

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("csrc") / "paged_decode_attention_cpu.c"
SOURCES = (SOURCE, SOURCE.with_name("gemm_cpu.c"), SOURCE.with_name("gemm_tile_cpu.c"), SOURCE.with_name("gemm_quant_cpu.c"),
           SOURCE.with_name("qdot_cpu.c"), SOURCE.with_name("qdot_avxvnni_cpu.c"),
           SOURCE.with_name("qdot_avx512vnni_cpu.c"), SOURCE.with_name("elementwise_cpu.c"),
           SOURCE.with_name("decode_layers_cpu.c"), SOURCE.with_name("prefill_attention_cpu.c"),
           # the two attention kernels again, reading a bf16 cache (they include the files above)
           SOURCE.with_name("paged_decode_attention_bf16_cpu.c"),
           SOURCE.with_name("prefill_attention_bf16_cpu.c"))  # one library
HEADERS = (SOURCE.with_name("gemm_tile.h"), SOURCE.with_name("bf16.h"), SOURCE.with_name("quant_block.h"))
FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]  # compiling
# Linking is a separate step without -ffast-math: with it gcc links crtfastmath.o, whose
# constructor sets flush-to-zero / denormals-are-zero for the whole process that loads us.
LINK_FLAGS = ["-shared", "-fopenmp"]
VECTOR_EXP = (["-fopenmp-simd"], ["-lmvec"])  # glibc's vector expf (compile, link); retried without
ERRORS = {1: "bad arguments (a context longer than its block table, or a block id outside the cache)",
          2: "out of memory"}


class NativeKernelError(RuntimeError):
    """The native kernel refused a call (bad block table or context length)."""


def enabled() -> bool:
    return os.environ.get("PDSERVE_CPU_ATTENTION", "native").strip().lower() != "torch"


def cpu_model() -> str:
    """The CPU's model and feature flags: `-march=native` code must not load on a CPU
    (or a VM) that lacks an instruction set it was built with."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        seen = {ln.split(":")[0].strip(): ln for ln in lines if ln.startswith(("model name", "flags"))}
        if seen:
            return "\n".join(seen[k] for k in sorted(seen))
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler_version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def build(cache_dir: Path | None = None) -> Path:
    """Compile the kernel if needed; returns the shared library's path. Raises OSError
    (no compiler) or RuntimeError (the compiler failed, with its output)."""
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        raise OSError(f"no C compiler {cc!r} on PATH (install gcc, or set CC)")
    flags = FLAGS + shlex.split(os.environ.get("PDSERVE_KERNEL_CFLAGS", ""))
    key = hashlib.sha256("\n".join([*(src.read_text() for src in SOURCES + HEADERS), " ".join(flags + LINK_FLAGS + [*VECTOR_EXP[0], *VECTOR_EXP[1]]),
                                    _compiler_version(cc),
                                    cpu_model()]).encode()).hexdigest()[:16]
    root = cache_dir or Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve")) / "kernels"
    lib = root / f"pdserve_cpu-{key}.so"
    if lib.is_file():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with replaced(lib, mode=0o755) as tmp:  # a concurrent builder's identical file may be replaced
        objs = [f"{tmp}.{i}.o" for i in range(len(SOURCES))]
        try:
            for compile_extra, link_extra in (VECTOR_EXP, ([], [])):
                for src, obj in zip(SOURCES, objs):
                    res = subprocess.run([cc, *flags, *compile_extra, "-c", "-o", obj, str(src)], capture_output=True,
                                         text=True, timeout=300)
                    if res.returncode:
                        break
                if res.returncode == 0:
                    res = subprocess.run([cc, *LINK_FLAGS, "-o", tmp, *objs, *link_extra, "-lm"], capture_output=True,
                                         text=True, timeout=300)
                if res.returncode == 0:
                    break
            else:
                raise RuntimeError(f"{cc} failed to build {lib.name}:\n{res.stderr.strip()}")
        finally:
            for obj in objs:
                if os.path.exists(obj):
                    os.unlink(obj)
    return lib


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded kernel, or None (no compiler, or the build failed: warned once)."""
    try:
        lib = ctypes.CDLL(str(build()))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native CPU attention unavailable, using the torch path: %s", e)
        return None
    fn = lib.pd_paged_decode_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 13 + [ctypes.c_float, ctypes.c_int]
    fn = lib.pd_paged_decode_attention_bf16  # the same arguments, the caches bf16
    fn.restype, fn.argtypes = lib.pd_paged_decode_attention.restype, lib.pd_paged_decode_attention.argtypes
    fn = lib.pd_gemm
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 3
                   + [ctypes.c_int64] * 2 + [ctypes.c_int])
    fn = lib.pd_gemm_bf16  # pd_gemm's arguments, on bf16 panels
    fn.restype, fn.argtypes = lib.pd_gemm.restype, lib.pd_gemm.argtypes
    fn = lib.pd_add_rms_norm
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_float] + [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 4 + [ctypes.c_int]
    fn = lib.pd_prefill_attention
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64] + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2
                   + [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 11 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int])
    fn = lib.pd_prefill_attention_bf16
    fn.restype, fn.argtypes = lib.pd_prefill_attention.restype, lib.pd_prefill_attention.argtypes
    fn = lib.pd_qk_norm_rope
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_void_p] * 2 + [ctypes.c_float]
                   + [ctypes.c_void_p] * 2 + [ctypes.c_int])
    fn = lib.pd_silu_mul
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 3 + [ctypes.c_int]
    fn = lib.pd_gemm_silu
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64] + [ctypes.c_void_p] * 2
                   + [ctypes.c_int64] * 2 + [ctypes.c_int])
    fn = lib.pd_gemm_silu_bf16
    fn.restype, fn.argtypes = lib.pd_gemm_silu.restype, lib.pd_gemm_silu.argtypes
    for name in ("pd_gemm_q", "pd_gemm_silu_q"):  # pd_gemm's / pd_gemm_silu's arguments, the weight's kind after p
        for fn in (getattr(lib, name), getattr(lib, name + "_dequant"), getattr(lib, name + "dot")):
            fn.restype = ctypes.c_int
            args = getattr(lib, name.removesuffix("_q")).argtypes
            fn.argtypes = args[:5] + [ctypes.c_int] + args[5:]
    fn = lib.pd_quantize_rows_q8
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] * 3
    for name in ("pd_qdot_variants", "pd_qdot_variant", "pd_qdot_set_variant"):
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int] if name.endswith("set_variant") else []
    lib.pd_qdot_set_variant(qdot_variant_for(lib.pd_qdot_variants()))
    fn = lib.pd_store_kv
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64] * 2 + [ctypes.c_void_p] + [ctypes.c_int64] * 3
                   + [ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_void_p] + [ctypes.c_int64] * 5 + [ctypes.c_int])
    fn = lib.pd_store_kv_bf16
    fn.restype, fn.argtypes = lib.pd_store_kv.restype, lib.pd_store_kv.argtypes
    fn = lib.pd_decode_layers
    fn.restype = ctypes.c_int
    fn.argtypes = ([ctypes.c_void_p] + [ctypes.c_int64] * 9 + [ctypes.c_float] * 3 + [ctypes.c_void_p] * 7
                   + [ctypes.c_int64, ctypes.c_int] + [ctypes.c_void_p] * 3)
    return lib


# The int8 dot products' variants (kernels/csrc/qdot_cpu.c, "VNNI"): the same bits each
QDOT_VARIANTS = {0: "maddubs", 1: "avx_vnni", 2: "avx512_vnni"}


def qdot_variant_for(available: int) -> int:
    """Which int8 dot products to run, of those the library says the CPU and OS allow
    (`available`: bits 1 << variant, from pd_qdot_variants): AVX-VNNI's vpdpbusd where
    there, else AVX512-VNNI's (256-bit), else maddubs. AVX2's maddubs alone under
    ``PDSERVE_CPU_VNNI=0`` and under `--emulate-avx2` (PDSERVE_EMULATE_AVX2=1); no AVX-512
    under an AVX2 build (``-mno-avx512f``)."""
    if os.environ.get("PDSERVE_CPU_VNNI", "").strip() == "0" or os.environ.get("PDSERVE_EMULATE_AVX2") == "1":
        return 0
    if "-mno-avx512f" in os.environ.get("PDSERVE_KERNEL_CFLAGS", ""):
        available &= ~(1 << 2)
    return next((v for v in (1, 2) if available >> v & 1), 0)


def qdot_variant() -> str:
    """The int8 dot products the loaded library runs (QDOT_VARIANTS' names)."""
    lib = library()
    return "none" if lib is None else QDOT_VARIANTS[lib.pd_qdot_variant()]


# What a KV cache may hold for the native kernels: float32, or bf16 (stored rounded to
# nearest even, widened to float32 in registers as it is read; q and outputs float32).
KV_DTYPES = (torch.float32, torch.bfloat16)


def supports(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the native kernel takes this call: enabled, CPU float32 q, a float32 or
    bf16 cache, built."""
    return (enabled() and q.device.type == "cpu" and q.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in KV_DTYPES and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
            and library() is not None)


def paged_decode_attention(
    q: torch.Tensor,  # [B, Hq, D] float32, CPU
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], last dim contiguous
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D], last dim contiguous
    block_tables: torch.Tensor,  # [B, max_blocks] int32, -1 padded
    context_lens: torch.Tensor,  # [B] int32
    scale: float,
) -> torch.Tensor:  # [B, Hq, D]
    """Decode attention reading the paged cache in place (see the module docstring)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU attention kernel is not available (see the warning above)")
    b, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    q = q.contiguous()
    tables = block_tables.to(torch.int32).contiguous()
    lens = context_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if b == 0:
        return out
    fn = lib.pd_paged_decode_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.pd_paged_decode_attention
    status = fn(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), lens.data_ptr(),
        out.data_ptr(), b, hq, hkv, d, block_size, tables.shape[1], num_blocks,
        *k_cache.stride()[:3], *v_cache.stride()[:3], scale, torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native paged decode attention: {ERRORS.get(status, f'error {status}')}")
    return out


def supports_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `prefill_attention` takes this call: `supports` and a head dim in whole
    16-value panels."""
    return supports(q, k_cache, v_cache) and q.shape[-1] % PANEL == 0 and q.stride(-1) == 1 and q.stride(1) == q.shape[-1]


def prefill_attention(
    q: torch.Tensor,  # [N, Hq, D] float32, heads D apart, rows any distance apart
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    tables: torch.Tensor,  # [P, max_blocks] int32, -1 padded
    q_start: list[int],  # per sequence: its first row in q
    q_lens: list[int],  # per sequence
    ctx_lens: list[int],  # per sequence, including its q tokens (stored in the cache already)
    scale: float,
    out: torch.Tensor | None = None,  # [N, Hq, D] contiguous float32, to write into
) -> torch.Tensor:  # [N, Hq, D]; rows outside the sequences' ranges are left as they were
    """Causal attention of P prompt chunks over the paged cache (prefill_attention_cpu.c)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see the warning above)")
    n, hq, d = q.shape
    num_blocks, block_size, hkv, _ = k_cache.shape
    if out is None:
        out = torch.empty((n, hq, d), dtype=torch.float32)
    elif out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError("prefill_attention: out must be a contiguous float32 tensor shaped like q")
    if not q_lens:
        return out
    tables = tables.to(torch.int32).contiguous()
    starts, lens, ctxs = (torch.tensor(v, dtype=torch.int32) for v in (q_start, q_lens, ctx_lens))
    if any(s + ln > n for s, ln in zip(q_start, q_lens)) or tables.shape[0] != len(q_lens):
        raise ValueError("prefill_attention: a sequence's rows fall outside q, or tables do not match the sequences")
    fn = lib.pd_prefill_attention_bf16 if k_cache.dtype == torch.bfloat16 else lib.pd_prefill_attention
    status = fn(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(), tables.shape[1],
                num_blocks, starts.data_ptr(), lens.data_ptr(), ctxs.data_ptr(), len(q_lens), hq, hkv, d, block_size,
                *k_cache.stride()[:3], *v_cache.stride()[:3], scale, out.data_ptr(), torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native prefill attention: {ERRORS.get(status, f'error {status}')}")
    return out


# Output columns per panel of a packed weight (NR in kernels/csrc/gemm_cpu.c).
PANEL = 16
# What a packed weight may hold: float32, or bf16 widened to float32 in registers (the
# products are float32 either way; bf16 streams half the bytes).
PACKED_DTYPES = (torch.float32, torch.bfloat16)


def pack_weight(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """weight [n, k] -> [ceil(n / PANEL), k, PANEL] in `dtype` (default: float32, or bf16
    for a bf16 weight; rounded to nearest even when narrowed), the layout `gemm` reads:
    panel j holds output columns PANEL j .. PANEL j + PANEL - 1, k-major, zero past n. A
    second copy of the weight in memory, on huge pages where the kernel grants them
    (`huge_pages`)."""
    if dtype is None:
        dtype = torch.bfloat16 if weight.dtype == torch.bfloat16 else torch.float32
    if dtype not in PACKED_DTYPES:
        raise ValueError(f"pack_weight: dtype {dtype} is not one of {PACKED_DTYPES}")
    n, k = weight.shape
    pad = -n % PANEL
    w = weight.detach().to(dtype)
    if pad:
        w = torch.cat((w, w.new_zeros(pad, k)))
    out = huge_pages.empty(((n + pad) // PANEL, k, PANEL), dtype)  # streamed every decode step
    out.copy_(w.reshape(-1, PANEL, k).transpose(1, 2))
    return out


def library_and_rows(x: torch.Tensor) -> tuple[ctypes.CDLL, torch.Tensor]:
    """The built library, and x with unit stride along its rows (what the GEMMs read)."""
    lib = library()
    if lib is None:
        raise RuntimeError("the native CPU kernels are not available (see the warning above)")
    return lib, x if x.stride(-1) == 1 else x.contiguous()


def gemm(x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [m, k] @ weight[n, k]^T (+ bias [n]) -> [m, n], float32 on CPU, with `packed` =
    pack_weight(weight) in float32 or bf16 (kernels/csrc/gemm_cpu.c)."""
    lib, x = library_and_rows(x)
    m, k = x.shape
    if (packed.dim() != 3 or packed.shape[1:] != (k, PANEL) or packed.shape[0] * PANEL < n or not packed.is_contiguous()
            or packed.dtype not in PACKED_DTYPES):
        raise ValueError(f"gemm: packed weight of shape {tuple(packed.shape)} does not fit x [{m}, {k}] and n={n}")
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    y = torch.empty((m, n), dtype=torch.float32)
    fn = lib.pd_gemm_bf16 if packed.dtype == torch.bfloat16 else lib.pd_gemm
    status = fn(x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                y.data_ptr(), n, n, torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native gemm: bad arguments (status {status})")
    return y


def gemm_silu(x: torch.Tensor, packed: torch.Tensor, inter: int) -> torch.Tensor:
    """silu(x @ gate^T) * (x @ up^T) -> [m, inter], float32 on CPU, with `packed` =
    pack_weight([gate; up]) ([2 inter, k], inter a multiple of PANEL; float32 or bf16): SwiGLU's two
    projections and activation in one pass (pd_gemm_silu in kernels/csrc/gemm_cpu.c), the
    same bits as silu_mul(gemm(x, packed, 2 * inter))."""
    lib, x = library_and_rows(x)
    m, k = x.shape
    if (inter % PANEL or packed.dim() != 3 or packed.shape != (2 * inter // PANEL, k, PANEL)
            or not packed.is_contiguous() or packed.dtype not in PACKED_DTYPES):
        raise ValueError(f"gemm_silu: packed weight of shape {tuple(packed.shape)} does not fit x [{m}, {k}] "
                         f"and inter={inter} (a multiple of {PANEL})")
    act = torch.empty((m, inter), dtype=torch.float32)
    fn = lib.pd_gemm_silu_bf16 if packed.dtype == torch.bfloat16 else lib.pd_gemm_silu
    if fn(x.data_ptr(), x.stride(0), m, k, packed.data_ptr(), act.data_ptr(), inter, inter,
                        torch.get_num_threads()):
        raise NativeKernelError("native gemm_silu: bad arguments")
    return act


def supports_rows(*tensors: torch.Tensor) -> bool:
    """Whether the fused elementwise kernels take these [rows, dim] tensors: enabled, CPU
    float32, unit stride along dim, built."""
    return (enabled() and all(t.device.type == "cpu" and t.dtype == torch.float32 and t.dim() == 2 and t.stride(1) == 1
                              for t in tensors) and library() is not None)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual) * weight, x + residual) in one pass; residual None: (rms_norm(x) * weight, x)."""
    rows, dim = x.shape
    out = torch.empty((rows, dim), dtype=x.dtype)
    res_out = torch.empty((rows, dim), dtype=x.dtype)
    weight = weight.contiguous()
    status = library().pd_add_rms_norm(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(),
                                       eps, out.data_ptr(), res_out.data_ptr(), rows, dim, x.stride(0),
                                       dim if residual is None else residual.stride(0), torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native add_rms_norm: bad arguments (status {status})")
    return out, res_out


def supports_store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether `store_kv` takes these: enabled, CPU, float32 key and value, float32 or bf16
    caches (rounded to nearest even), unit stride along the head dim, built."""
    ts = (key, value, k_cache, v_cache)
    return (enabled() and all(t.device.type == "cpu" and t.stride(-1) == 1 for t in ts)
            and key.dtype == value.dtype == torch.float32 and k_cache.dtype == v_cache.dtype
            and k_cache.dtype in KV_DTYPES
            and key.dim() == value.dim() == 3 and k_cache.dim() == v_cache.dim() == 4 and library() is not None)


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [N, Hkv, D] into the caches [num_blocks, block_size, Hkv, D] (any strides
    but the last) at `slot_mapping` [N] (-1: skip), in place."""
    n, hkv, d = key.shape
    num_blocks, block_size = k_cache.shape[:2]
    if value.shape != key.shape or k_cache.shape[2:] != (hkv, d) or v_cache.shape != k_cache.shape:
        raise ValueError(f"store_kv: key {tuple(key.shape)}, value {tuple(value.shape)} and caches "
                         f"{tuple(k_cache.shape)}, {tuple(v_cache.shape)} do not fit")
    slots = slot_mapping.to(torch.int64).contiguous()
    if slots.shape != (n,):
        raise ValueError(f"store_kv: {tuple(slots.shape)} slots for {n} tokens")
    lib = library()
    fn = lib.pd_store_kv_bf16 if k_cache.dtype == torch.bfloat16 else lib.pd_store_kv
    status = fn(key.data_ptr(), key.stride(0), key.stride(1), value.data_ptr(), value.stride(0), value.stride(1),
                k_cache.data_ptr(), *k_cache.stride()[:3], v_cache.data_ptr(), *v_cache.stride()[:3], slots.data_ptr(),
                n, hkv, d, block_size, num_blocks, torch.get_num_threads())
    if status:
        raise ValueError(f"store_kv: a slot past the cache's {num_blocks * block_size}")


def qk_norm_rope_(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, q_norm: torch.Tensor | None,
                  k_norm: torch.Tensor | None, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """In place: qkv [N, >= (Hq + Hkv) D] (unit stride along the row), its q and k heads
    normed (q_norm / k_norm [D], both or neither) and rotated by cos / sin [N, D] (sin's
    first half negated)."""
    rows = qkv.shape[0]
    cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim):
        raise ValueError("qk_norm_rope_: cos and sin must be [rows, head_dim]")
    qn = None if q_norm is None else q_norm.contiguous()
    kn = None if k_norm is None else k_norm.contiguous()
    status = library().pd_qk_norm_rope(qkv.data_ptr(), rows, qkv.stride(0), num_heads, num_kv_heads, head_dim,
                                       0 if qn is None else qn.data_ptr(), 0 if kn is None else kn.data_ptr(), eps,
                                       cos.data_ptr(), sin.data_ptr(), torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native qk_norm_rope: bad arguments (status {status})")


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [rows, 2 * dim] -> silu(gate) * up [rows, dim]."""
    rows, two_dim = gate_up.shape
    out = torch.empty((rows, two_dim // 2), dtype=gate_up.dtype)
    status = library().pd_silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, two_dim // 2, gate_up.stride(0),
                                   torch.get_num_threads())
    if status:
        raise NativeKernelError(f"native silu_mul: bad arguments (status {status})")
    return out
