"""The bottom of the config modules, imported by config.py and by the readers it uses
(checkpoint_dtype, quantization, rope_config): the error a user can act on, the dtype
names, and reading a model folder's JSON files."""
from __future__ import annotations

import json
from pathlib import Path

import torch

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


class ConfigError(ValueError):
    """A user-supplied setting or model file is unusable; the message says which and why."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (choose from {sorted(set(DTYPES))})")
    return DTYPES[name]


def read_json(path: Path) -> dict:
    """A JSON object from a model file, or ConfigError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data
