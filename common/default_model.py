"""The embedded default model: a tiny Qwen3 made on first use into a cache directory."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from common.model_factory import make_model

DEFAULT_ARCH, DEFAULT_SIZE, DEFAULT_SEED = "qwen3", "tiny", 0


def cache_root() -> Path:
    return Path(os.environ.get("PDSERVE_CACHE", Path.home() / ".cache" / "pdserve"))


def default_model_dir() -> Path:
    """Path of the default model, creating it (atomically) if it is not there yet."""
    target = cache_root() / f"default-{DEFAULT_ARCH}-{DEFAULT_SIZE}-seed{DEFAULT_SEED}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".making-"))
    try:
        make_model(tmp, DEFAULT_ARCH, DEFAULT_SIZE, DEFAULT_SEED)
        try:
            tmp.rename(target)
        except OSError:  # another process made it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model(model: str | None) -> str:
    """The model directory a command was given, or the default model's (made on first use)."""
    return model if model else str(default_model_dir())
