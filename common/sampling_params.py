"""Per-request sampling parameters: the one form they take everywhere, from the offline
API and the HTTP body to the wire (common/wire/messages.py registers this class as the
"sampling" structure) and the sampler. Torch-free: the router imports it."""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any


# The one set of limits on sampling values, checked at the edge and again by every engine.
# Each keeps a value inside what msgpack (64-bit ints) and torch (int64, float32) hold.
GREEDY_EPSILON = 1e-5  # temperatures below this sample greedily, as in vLLM (1/t would overflow float32)
MAX_TEMPERATURE = 100.0  # above ~10 the distribution is already flat; bounded so 1/t stays normal
MAX_TOP_K = 2**31 - 1  # the sampler clamps it to the vocabulary
MAX_TOKENS_LIMIT = 2**31 - 1  # the engine also stops at max_model_len
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1024


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range; the message names it and its limit."""


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    `temperature=0` (or anything below `GREEDY_EPSILON`) is greedy (exact argmax).
    `top_k=-1` and `top_p=1.0` disable those filters. The same `seed` gives the same output for the same prompt.

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
        """SamplingParamsError naming the first value out of range (see the limits above)."""
        if not 0 <= self.temperature <= MAX_TEMPERATURE:  # also rejects NaN and inf
            raise SamplingParamsError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                                      f"got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:  # NaN fails this too
            raise SamplingParamsError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or not -1 <= self.top_k <= MAX_TOP_K:
            raise SamplingParamsError(f"top_k must be -1 (off) or in [1, {MAX_TOP_K}], got {self.top_k}")
        if self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens > MAX_TOKENS_LIMIT:
            raise SamplingParamsError(f"max_tokens must be <= {MAX_TOKENS_LIMIT}, got {self.max_tokens}")
        if self.stop is not None:
            if len(self.stop) > MAX_STOP_STRINGS:
                raise SamplingParamsError(f"stop may list at most {MAX_STOP_STRINGS} strings, got {len(self.stop)}")
            for s in self.stop:
                if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                    raise SamplingParamsError(f"each stop string must be non-empty text of at most "
                                              f"{MAX_STOP_CHARS} characters, got {str(s)[:40]!r}")
                if not _is_unicode(s):
                    raise SamplingParamsError(f"stop string {s[:40]!r} is not valid Unicode (lone surrogate)")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise SamplingParamsError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON


def _is_unicode(text: str) -> bool:
    """False for text holding a lone surrogate (JSON lets "\\ud800" through; UTF-8 cannot carry it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
