"""The speculative decoding configuration (vLLM's `--speculative-config JSON`), validated at
the edge like the rest of config.py, which re-exports it."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.common import schema
from pdserve.common.config_base import ConfigError, json_object
from pdserve.common.quantization import QUANTIZATIONS

SPECULATIVE_METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16  # a verification step holds 1 + k query rows per sequence
_SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
                     "quantization", "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config JSON`, vLLM's keys; common/engine/spec/):
    `method` "ngram" proposes the `num_speculative_tokens` tokens that followed the
    latest earlier occurrence of the sequence's last n tokens (n from `prompt_lookup_max`
    down to `prompt_lookup_min`: prompt lookup); "draft_model" lets `model` (a model
    folder with the target's tokenizer, or "self": the target's own folder) propose them,
    run in its own weight `quantization` (none, int8, int4, gguf, auto). `adaptive`
    (pdserve's own key): propose only where the measured acceptance and step costs say
    it pays; off, every decoding sequence proposes every step."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    quantization: str = "auto"
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ConfigError(f"speculative_config: method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                              f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ConfigError(f"speculative_config: num_speculative_tokens must be in [1, {MAX_SPECULATIVE_TOKENS}], "
                              f"got {self.num_speculative_tokens}")
        if self.method == "ngram":
            if self.model is not None:
                raise ConfigError("speculative_config: method 'ngram' takes no model")
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            # vLLM's defaults: both 5 when neither is given, else the one given for both
            lo, hi = (5, 5) if lo is None and hi is None else (lo if lo is not None else hi, hi if hi is not None else lo)
            if not 1 <= lo <= hi:
                raise ConfigError(f"speculative_config: need 1 <= prompt_lookup_min <= prompt_lookup_max, "
                                  f"got {lo} and {hi}")
            object.__setattr__(self, "prompt_lookup_min", lo)
            object.__setattr__(self, "prompt_lookup_max", hi)
        elif not self.model:
            raise ConfigError("speculative_config: method 'draft_model' needs a model (a folder, or \"self\")")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"speculative_config: quantization must be one of {', '.join(QUANTIZATIONS)}, "
                              f"got {self.quantization!r}")

    @classmethod
    def parse(cls, value: "str | dict[str, Any]") -> "SpeculativeConfig":
        """From vLLM's form: a JSON object (as `--speculative-config` takes it) or a dict
        (`LLM(speculative_config=...)`). Without a method, a model means draft_model.
        ConfigError names what is wrong."""
        if isinstance(value, str):
            value = json_object(value, "speculative_config")
        if not isinstance(value, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(_SPECULATIVE_KEYS)})")
        data = dict(value)
        if "method" not in data and data.get("model"):
            data["method"] = "draft_model"
        if "method" not in data or "num_speculative_tokens" not in data:
            raise ConfigError("speculative_config needs method and num_speculative_tokens")
        return schema.build(cls, data, "speculative_config", ConfigError)

    def draft_dir(self, model_dir: str | Path) -> str:
        """The draft model's folder: `model`, or the target's for "self"."""
        assert self.model is not None
        return str(model_dir) if self.model == "self" else self.model
