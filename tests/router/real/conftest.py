"""The real default model's float32 conversion (`--quantization none`: the served tests
compare with transformers token for token) behind `pdserve serve` 1P+1D, for every test
file here: started
once (a real-model start-up costs tens of seconds on 2 cores) and stopped, checked to
leave no worker behind, after the last of them. Package-scoped so that it goes as soon as
these files are done, not at the end of tests/router."""
from __future__ import annotations

import openai
import pytest

from tests.support.serving import REAL_MAX_MODEL_LEN as MAX_MODEL_LEN
from tests.support.serving import openai_client, serving_pd


@pytest.fixture(scope="package")
def served(real_model_dir, tmp_path_factory):
    with serving_pd(real_model_dir, tmp_path_factory.mktemp("serve_real"), MAX_MODEL_LEN, timeout=300,
                    extra=("--quantization", "none")) as s:
        yield s


@pytest.fixture(scope="package")
def client(served) -> openai.OpenAI:
    return openai_client(served)
