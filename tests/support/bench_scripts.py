"""A benchmark script as a module, for its tests: the scripts put benchmarks/ on sys.path
to import their siblings by name, where benchmarks/kv_transfer.py would shadow the
kv_transfer package -- so the package is imported first, and sys.path is put back after."""
from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType


@contextlib.contextmanager
def script(name: str) -> Iterator[ModuleType]:
    """benchmarks/<name>.py imported, for the `with` block."""
    from pdserve import kv_transfer  # noqa: F401

    saved = list(sys.path)
    try:
        yield importlib.import_module(f"benchmarks.{name}")
    finally:
        sys.path[:] = saved
