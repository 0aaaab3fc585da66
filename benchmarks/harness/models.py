"""The models benchmarks run: a given HuggingFace-format folder, the small random qwen3 made
once under results/models (39M parameters: every comparison's default), or a tiny one."""
from __future__ import annotations

import sys
from pathlib import Path

from benchmarks.harness.paths import RESULTS

SMALL_QWEN3 = RESULTS / "models" / "qwen3-small"  # `pdserve make-model --arch qwen3 --size small --seed 0`
TINY_QWEN3 = RESULTS / "models" / "qwen3-tiny"  # `--size tiny --seed 0`


def make_if_missing(path: str | Path, size: str = "small", arch: str = "qwen3", seed: int = 0) -> Path:
    """`path`, with a random `make-model` model written there first if it holds none."""
    path = Path(path)
    if not (path / "config.json").is_file():
        from pdserve.common.loading.model_factory import make_model
        print(f"making the {size} {arch} model in {path}", flush=True)
        make_model(path, arch, size, seed=seed)
    return path


def ensure_model(model: str | Path | None, size: str = "small") -> Path:
    """The given model folder (which must exist), else the small (or tiny) qwen3, made once."""
    if model is not None:
        path = Path(model)
        if not (path / "config.json").is_file():
            sys.exit(f"--model {model}: no config.json there; pass a HuggingFace-format model directory")
        return path
    return make_if_missing(SMALL_QWEN3 if size == "small" else TINY_QWEN3, size)


def default_model() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct, Q4_1 kept quantized), converted once."""
    from pdserve.common.loading.default_model import resolve_model
    return Path(resolve_model(None))
