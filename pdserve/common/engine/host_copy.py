"""Step inputs from the host to the model's device without a host synchronisation.

`torch.tensor(values, device="cuda")` (and `.to("cuda")`) copies and then waits for the
device's stream to drain: in a step, each such copy stops the host until every kernel
queued before it has run. A copy from pageable memory with non_blocking=True is staged by
CUDA before the call returns, so the host array may be dropped at once and nothing waits.
On the CPU both are the tensor itself.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(host: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`host` (an array or a CPU tensor) on `device`, queued behind the stream's work."""
    t = torch.from_numpy(host) if isinstance(host, np.ndarray) else host
    return t.to(device, non_blocking=True)


def device_tensor(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """torch.tensor(values, dtype=dtype, device=device), without waiting for the stream."""
    return to_device(torch.tensor(values, dtype=dtype), device)
