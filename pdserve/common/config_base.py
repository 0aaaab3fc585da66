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


def json_object(text: str | bytes, what: str, hint: str = "") -> dict:
    """`text` as a JSON object, or ConfigError naming `what` it is (a file, a flag, an
    option), with `hint` (e.g. an example) after "must be a JSON object"."""
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{what} must be a JSON object{hint}; it is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{what} must be a JSON object{hint}, got {type(data).__name__}")
    return data


def read_json(path: Path) -> dict:
    """A JSON object from a model file, or ConfigError naming the file."""
    return json_object(path.read_bytes(), str(path))
