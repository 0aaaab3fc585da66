"""Shared pieces of pdserve: config, messages, sequence, block manager, model code,
weight loading, sampler, tokenizer, metrics and the offline engine.

`LLM` and `SamplingParams` are imported lazily so that light processes (the router)
can import `common.*` modules without loading torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.common.engine.llm import LLM
        return LLM
    if name == "SamplingParams":
        from pdserve.common.sampling_params import SamplingParams
        return SamplingParams
    raise AttributeError(f"module 'pdserve.common' has no attribute {name!r}")
