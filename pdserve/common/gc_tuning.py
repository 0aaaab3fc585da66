"""Python's cycle collector in a serving process. A worker holds ~200k long-lived objects
after start-up (the model's modules, torch, tokenizer, transformers), and every
oldest-generation collection walks them all: a stall of a hundred-odd milliseconds for
every request in the step it lands in, often enough to set a serving run's p99.
Start-up objects are frozen (`gc.freeze`) once the process is ready, so later
collections walk only what serving allocates. vLLM does the same in its engine core,
API server and load generator."""
from __future__ import annotations

import gc


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every tracked object out of the
    collector's reach (they stay alive as before). Returns how many were frozen."""
    for generation in (0, 1, 2):
        gc.collect(generation)
    gc.freeze()
    return gc.get_freeze_count()
