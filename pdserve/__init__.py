"""pdserve: prefill/decode-disaggregated LLM serving.

The public API, as vLLM's::

    from pdserve import LLM, SamplingParams, Client, AsyncClient

`LLM(model_dir, **options).generate(prompts, sampling_params)` is the offline engine;
`Client` / `AsyncClient` speak to a running `pdserve serve` over ZeroMQ. The design's
parts are this package's sub-packages (`pdserve.router`, `pdserve.prefill_node`,
`pdserve.decode_node`, `pdserve.kv_transfer`, `pdserve.common`, `pdserve.kernels`);
nothing else is installed at the top of site-packages.

The names are imported on first use, so `import pdserve` (and the router, which never
loads a model) does not import torch.
"""
from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams", "Client", "AsyncClient"]

_WHERE = {
    "LLM": "pdserve.common.engine.llm",
    "SamplingParams": "pdserve.common.sampling_params",
    "Client": "pdserve.router.client",
    "AsyncClient": "pdserve.router.client",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_WHERE[name]), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
