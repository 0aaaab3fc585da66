"""gpu_check's models and its oracle: random tiny models of each architecture (or the one
given with --model) and transformers' greedy tokens on the device, with the prompts the
CPU tests use."""
from __future__ import annotations

from pathlib import Path


from benchmarks.gpu.exactness import hf_greedy  # noqa: F401  (gpu_check.py takes it from here)

ARCHS = ("qwen3", "qwen2", "llama")


def make_models(root: Path) -> dict[str, str]:
    from pdserve.common.loading.model_factory import make_model
    dirs = {arch: str(make_model(root / arch, arch, "tiny", seed=1)) for arch in ARCHS}
    dirs["small-qwen3"] = str(make_model(root / "small-qwen3", "qwen3", "small", seed=0))
    return dirs


def given_model(model: str) -> dict[str, str]:
    """--model: a folder, a .gguf file (converted to a cached folder, as `pdserve serve`
    does) or 'default', keyed by its name."""
    from pdserve.common.loading.default_model import resolve_model
    d = resolve_model(None if model == "default" else model)
    return {Path(model).stem if model != "default" else "default": d}


def prompts_for(model_dir: str) -> list[list[int]]:
    from pdserve.common.config import ModelConfig
    from tests.support.helpers import mixed_prompts  # the prompts the CPU tests use: block edges, shared prefixes
    return mixed_prompts(ModelConfig.from_dir(model_dir).vocab_size, seed=7)
