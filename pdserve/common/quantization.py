"""`--quantization`: weight-only int8 / int4 linears, and which a model folder asks for.

    none  every weight in the engine dtype
    int8  the decoder's linears and the lm_head quantized from the float weights to int8
          (GGUF Q8_0's form: a float16 scale per 32 inputs)
    int4  the decoder's linears to int4 (GGUF Q4_1's form: a float16 scale and minimum per
          32 inputs), the lm_head to int8 (as llama.cpp keeps its output layer wider)
    gguf  a folder converted from a GGUF file (`pdserve convert-gguf`, a .gguf MODEL, the
          default model): its Q8_0 / Q4_0 / Q4_1 linears kept as the file stores them (the
          same weights the float32 conversion holds, bit for bit), Q4_K as int4 with float16
          scales and minimums, Q5_K / Q6_K / Q5_0 / Q5_1 / Q2_K / Q3_K / IQ4_NL / IQ4_XS
          and fused groups of mixed kinds re-quantized to int8
          (common/loading/gguf_quant.py), the rest float
    auto  gguf for such a folder on the CPU, else none
Activations, norms, attention and the KV cache keep the engine dtype's policy
(common.models.precision); the native GEMM multiplies a decode batch's rows by int8 dot
products (each row rounded to int8 per 32 values, as llama.cpp does) and a prefill
chunk's by the float32 tile on the weights dequantized slice by slice
(kernels/csrc/gemm_quant_cpu.c). CPU only.
"""
from __future__ import annotations

import json
from pathlib import Path

from pdserve.common.config_base import ConfigError

QUANTIZATIONS = ("auto", "none", "int8", "int4", "gguf")
GGUF_SOURCE = "gguf_source.json"  # in a converted folder: the GGUF file it came from


def write_gguf_source(folder: Path, gguf: Path) -> None:
    """Record in `folder` the GGUF file its weights came from (path, size, mtime)."""
    st = gguf.stat()
    record = {"path": str(gguf.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    from pdserve.kernels.atomic_file import replaced  # here: importing pdserve.kernels imports torch, which
    # the router (it reads QUANTIZATIONS from this module) never loads; converting a GGUF has it already
    with replaced(folder / GGUF_SOURCE) as tmp:  # several workers may add it to one cached folder at once
        Path(tmp).write_text(json.dumps(record, indent=2))


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted folder came from, while it is there unchanged; else None."""
    try:
        record = json.loads((Path(model_dir) / GGUF_SOURCE).read_text())
        path = Path(record["path"])
        st = path.stat()
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return path if (st.st_size, st.st_mtime_ns) == (record.get("size"), record.get("mtime_ns")) else None


def resolve_quantization(requested: str, model_dir: str | Path, device: str) -> str:
    """The quantization an engine runs `requested` as: never "auto"."""
    if requested not in QUANTIZATIONS:
        raise ConfigError(f"quantization {requested!r} is not one of {', '.join(QUANTIZATIONS)}")
    if requested == "auto":
        return "gguf" if device == "cpu" and gguf_source(model_dir) is not None else "none"
    if requested != "none" and device != "cpu":
        raise ConfigError(f"quantization {requested!r} runs on the CPU only (device {device!r})")
    if requested == "gguf" and gguf_source(model_dir) is None:
        raise ConfigError(f"quantization 'gguf': {model_dir} was not converted from a GGUF file that is still "
                          f"in place (no {GGUF_SOURCE} naming an unchanged file)")
    return requested


def precision(dtype: str, quantization: str = "none") -> str:
    """What a fingerprint says an engine computes in: the dtype, "+" the quantization
    when there is one ("float32+int4")."""
    return dtype if quantization in ("none", "") else f"{dtype}+{quantization}"


def kept_linears(model) -> dict[str, list]:
    """A loaded model's quantized linears' weights (kernels.quant.QuantWeight) by kind:
    {"q8_0": [...], "q4_1": [...]}; empty where none is quantized."""
    kinds: dict[str, list] = {}
    for module in model.modules():
        if (quant := getattr(module, "quant", None)) is not None:
            kinds.setdefault(quant.kind, []).append(quant)
    return dict(sorted(kinds.items()))
