"""Per-request sampling parameters: the one form they take everywhere, from the offline
API and the HTTP body to the wire (common/messages.py registers this class as the
"sampling" structure) and the sampler. Torch-free: the router imports it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and its limit."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature=0` is greedy (exact argmax). `top_k=-1` and `top_p=1.0` disable those
    filters. The same `seed` gives the same output for the same prompt.

    Built by a user, it is checked at once. Decoded off the wire (`unchecked`) it is
    checked by whoever serves it (`validate()`), so the refusal can name the request.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 16
    stop: list[str] | None = field(default=None)
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", [self.stop])
        self.validate()

    @classmethod
    def unchecked(cls, **values: Any) -> "SamplingParams":
        """An instance from wire data, not yet validated (the codec checked the types)."""
        names = {f.name for f in fields(cls)}
        unknown = set(values) - names
        if unknown:
            raise TypeError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        obj = object.__new__(cls)
        for f in fields(cls):
            default = f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
            object.__setattr__(obj, f.name, values.get(f.name, default))
        return obj

    def validate(self) -> None:
        """SamplingParamsError naming the first value out of range."""
        if not (0 <= self.temperature < float("inf")):  # also rejects NaN
            raise SamplingParamsError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise SamplingParamsError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.stop is not None and any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
