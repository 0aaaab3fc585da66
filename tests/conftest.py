"""Test-wide setup. Environment first: Triton must see TRITON_INTERPRET before any kernel
module is imported, and nothing may reach a model hub."""
import os

os.environ["TRITON_INTERPRET"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402

from tests.helpers import hf_reference_cache  # noqa: E402

ARCHS = ("qwen3", "qwen2", "llama")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    """One tiny random model per architecture, made once per test session."""
    from common.model_factory import make_model
    root = tmp_path_factory.mktemp("models")
    return {arch: str(make_model(root / arch, arch, "tiny", seed=1)) for arch in ARCHS}


@pytest.fixture(scope="session")
def hf_greedy():
    """hf_greedy(model_dir, prompt_ids, max_new_tokens) -> transformers' greedy output ids."""
    return hf_reference_cache()
