"""Loading HuggingFace safetensors weights into the fused model parameters."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from pdserve.common.config import ConfigError, read_json
from pdserve.common.models.decoder import PACKED_MODULES


def load_weights(model: nn.Module, model_dir: str | Path) -> None:
    """Copy every tensor of `model_dir/*.safetensors` into `model`; fused q/k/v and
    gate/up parameters are filled shard by shard. Raises ConfigError naming the file or
    the missing tensors when the checkpoint is unusable."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    index = Path(model_dir) / "model.safetensors.index.json"
    if index.is_file():  # sharded: every shard the index names must be there
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError(f"{index} has no weight_map object")
        absent = sorted({f for f in weight_map.values() if not (Path(model_dir) / str(f)).is_file()})
        if absent:
            raise ConfigError(f"{index} names weight file(s) missing from {model_dir}: {', '.join(absent)}")
    if not files:
        raise ConfigError(f"no *.safetensors weight file in {model_dir}")
    params = dict(model.named_parameters(remove_duplicate=False))
    filled: set[tuple[str, int | None]] = set()
    tied = getattr(model.config, "tie_word_embeddings", False)
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    _load_one(params, filled, name, f.get_tensor(name), tied)
        except (SafetensorError, OSError) as e:
            raise ConfigError(f"cannot read weight file {path}: {e}") from None
    expected = {(n, i) for n, p in params.items() for i in _shards(p)}
    if tied:
        expected.discard(("lm_head.weight", None))
    missing = sorted(_checkpoint_name(n, i) for n, i in expected - filled)
    if missing:
        raise ConfigError(f"weights missing from {model_dir}: {', '.join(missing[:8])}"
                          + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))


def _target(name: str) -> tuple[str, int | None]:
    for hf, (ours, shard) in PACKED_MODULES.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), shard
    return name, None


def _load_one(params: dict[str, nn.Parameter], filled: set[tuple[str, int | None]], name: str, tensor: torch.Tensor,
              tied: bool) -> None:
    if tied and name == "lm_head.weight":
        return
    target, shard = _target(name)
    param = params.get(target)
    if param is None:
        if "rotary_emb" in name:
            return
        raise ConfigError(f"unexpected weight {name!r} in checkpoint")
    data = param.data
    if shard is not None:
        sizes = param.shard_sizes  # type: ignore[attr-defined]
        data = data.narrow(0, sum(sizes[:shard]), sizes[shard])
    if data.shape != tensor.shape:
        raise ConfigError(f"weight {name!r} has shape {tuple(tensor.shape)}, model expects {tuple(data.shape)}")
    data.copy_(tensor.to(data.dtype))
    filled.add((target, shard))


def _checkpoint_name(name: str, shard: int | None) -> str:
    """The checkpoint's own tensor name for one shard of a fused parameter."""
    if shard is None:
        return name
    for hf, (ours, i) in PACKED_MODULES.items():
        if i == shard and f".{ours}." in name:
            return name.replace(f".{ours}.", f".{hf}.")
    return f"{name}[{shard}]"


def _shards(param: nn.Parameter) -> list[int | None]:
    sizes = getattr(param, "shard_sizes", None)
    return list(range(len(sizes))) if sizes else [None]
