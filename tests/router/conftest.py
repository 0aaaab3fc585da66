"""Fixtures for the `pdserve serve` end-to-end tests. The prefill + decode deployment and
the one-colocated-worker deployment are package-scoped: each started once for every test
file here that asks for it, stopped (and checked to leave no worker behind) after the last
of them."""
from __future__ import annotations

import openai
import pytest

from pdserve.common.text.tokenizer import Tokenizer
from tests.support.helpers import one_torch_thread
from tests.support.serving import MAX_MODEL_LEN, RawClient, colocated_server, serving_pd


@pytest.fixture(scope="module")
def torch_one_thread_here():
    """The transformers oracle runs in this process next to 2+ workers on 2 shared cores.
    Not autouse: the pure router tests here need no torch at all."""
    with one_torch_thread():
        yield


@pytest.fixture(scope="package")
def model_dir(model_dirs) -> str:
    return model_dirs["qwen3"]


@pytest.fixture(scope="package")
def tok(model_dir) -> Tokenizer:
    return Tokenizer(model_dir)


@pytest.fixture(scope="package")
def pd(model_dir, tmp_path_factory):
    """One prefill + one decode worker behind the router; stopped with SIGTERM."""
    with serving_pd(model_dir, tmp_path_factory.mktemp("serve_pd"), MAX_MODEL_LEN) as served:
        yield served


@pytest.fixture(scope="package")
def colocated(model_dir, tmp_path_factory):
    """One colocated worker behind the router; stopped with SIGTERM."""
    yield from colocated_server(model_dir, tmp_path_factory.mktemp("serve_colocated"), MAX_MODEL_LEN)


@pytest.fixture(scope="package")
def oai(pd) -> openai.OpenAI:
    return openai.OpenAI(base_url=pd.http, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def raw(pd):
    """A raw client from docs/protocol.md (pyzmq + msgpack only) on the pd deployment."""
    client = RawClient(pd.zmq)
    yield client
    client.close()
