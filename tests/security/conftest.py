"""Fixtures for the attack tests: workers on one torch thread, like tests/disagg."""
from __future__ import annotations

import pytest

from tests.support.helpers import one_torch_thread


@pytest.fixture(autouse=True, scope="module")
def torch_one_thread_here():
    with one_torch_thread():
        yield
