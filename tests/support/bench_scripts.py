"""The one way tests reach a benchmark: a module of the `benchmarks` package by its dotted
name under it (`script("decode.parts")` is benchmarks/decode/parts.py). Benchmarks import
nothing from tests; tests import benchmarks only through here."""
from __future__ import annotations

import importlib
from types import ModuleType


def script(name: str) -> ModuleType:
    """benchmarks.<name>, imported."""
    return importlib.import_module(f"benchmarks.{name}")
