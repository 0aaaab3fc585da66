"""The bottom of the config modules, imported by config.py and by the readers it uses
(checkpoint_dtype, quantization, rope_config): the error a user can act on, the dtype
names, and reading a model folder's JSON files."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# Every spelling of a dtype a user may write -> its one name (torch's, without "torch.").
# Names, not torch dtypes: the router and the CLI validate dtypes without importing torch.
DTYPES = {"float32": "float32", "fp32": "float32", "float16": "float16", "fp16": "float16", "half": "float16",
          "bfloat16": "bfloat16", "bf16": "bfloat16"}


class ConfigError(ValueError):
    """A user-supplied setting or model file is unusable; the message says which and why."""


def dtype_name(dtype: "str | torch.dtype") -> str:
    """The one spelling of a dtype ("bf16" -> "bfloat16", torch.bfloat16 -> "bfloat16"), as
    fingerprints and the wire compare it; ConfigError for a name pdserve does not serve."""
    if not isinstance(dtype, str):  # a torch dtype
        return str(dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not supported (choose from {sorted(set(DTYPES))})")
    return DTYPES[dtype]


def parse_dtype(name: "str | torch.dtype") -> "torch.dtype":
    """`name` as a torch dtype (torch is imported here, on first use, not by the modules
    that only validate names)."""
    import torch
    return name if isinstance(name, torch.dtype) else getattr(torch, dtype_name(name))


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
