"""Fixtures for the engine-core tests."""
from __future__ import annotations

import pytest

from tests.support.helpers import one_torch_thread


@pytest.fixture
def torch_one_thread():
    """Run torch on one intra-op thread for the test, then restore the old count.

    The tiny test model gains nothing from a second thread, and on a 2-core machine
    shared with other jobs OpenMP spin-waiting makes each step ~100x slower.
    """
    with one_torch_thread():
        yield
