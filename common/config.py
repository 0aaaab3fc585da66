"""Frozen configuration objects: one per concern, composed into EngineConfig.

The CLI and the offline `LLM` fill these; everything downstream trusts them, so all
validation of user-supplied values happens here, at the edge.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.rope_config import RopeConfig

SUPPORTED_ARCHS = ("qwen3", "qwen2", "llama")
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
           "bf16": torch.bfloat16}


class ConfigError(ValueError):
    """A user-supplied setting or model file is unusable; the message says which and why."""


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ConfigError(f"dtype {name!r} is not supported (choose from {sorted(set(_DTYPES))})")
    return _DTYPES[name]


def read_json(path: Path) -> dict:
    """A JSON object from a model file, or ConfigError naming the file."""
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def _check_supported(cfg: dict, cfg_path: Path) -> None:
    """Refuse, naming the field and value, what the one decoder implementation cannot run."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{cfg_path}: hidden_act {act!r} is not supported (only 'silu')")
    if cfg.get("use_sliding_window"):
        raise ConfigError(f"{cfg_path}: use_sliding_window true is not supported (full attention only)")
    if cfg.get("mlp_bias"):
        raise ConfigError(f"{cfg_path}: mlp_bias true is not supported")
    # transformers 5 writes `dtype`, 4 wrote `torch_dtype`: the dtype on disk; the engine's
    # dtype is --dtype, and weights are converted on load
    for key in ("dtype", "torch_dtype"):
        value = cfg.get(key)
        if value is not None and value not in _DTYPES:
            raise ConfigError(f"{cfg_path}: {key} {value!r} is not supported (choose from {sorted(set(_DTYPES))})")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture read from a HuggingFace config.json."""

    model_dir: str
    arch: str  # qwen3 | qwen2 | llama
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...]
    rope: "RopeConfig | None" = None  # None: default RoPE with rope_theta

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "ModelConfig":
        path = Path(model_dir)
        cfg_path = path / "config.json"
        if not cfg_path.is_file():
            raise ConfigError(f"{cfg_path} not found: a model directory needs config.json")
        cfg = read_json(cfg_path)
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHS:
            raise ConfigError(f"unknown arch {arch!r} in {cfg_path} (supported: {', '.join(SUPPORTED_ARCHS)})")
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ConfigError(f"{cfg_path} lacks required field(s): {', '.join(missing)}")
        _check_supported(cfg, cfg_path)
        from common.rope_config import parse_rope  # imports ConfigError from here
        rope = parse_rope(cfg)
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // num_heads
        return cls(
            model_dir=str(path),
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=_eos_ids(path, cfg),
            rope=rope,
        )


def _eos_ids(path: Path, cfg: dict) -> tuple[int, ...]:
    """EOS ids as transformers' generate sees them: generation_config first, then config."""
    ids: list[int] = []
    gen_path = path / "generation_config.json"
    sources = [read_json(gen_path)] if gen_path.is_file() else []
    sources.append(cfg)
    for src in sources:
        eos = src.get("eos_token_id")
        if eos is None:
            continue
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, bool) or not isinstance(i, int):
                raise ConfigError(f"eos_token_id must be an id or a list of ids, got {eos!r}")
            if int(i) not in ids:
                ids.append(int(i))
        break
    return tuple(ids)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_blocks=None` sizes the cache from `memory_fraction`."""

    block_size: int = 16
    num_blocks: int | None = None
    memory_fraction: float = 0.2  # of total device (or host) memory, used only if num_blocks is None

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ConfigError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. `max_num_batched_tokens` is the per-step token budget."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in what precision the model runs."""

    device: str = "cpu"
    dtype: str = "float32"
    num_threads: int | None = None  # torch intra-op threads; None leaves torch's default

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ConfigError(f"device {self.device!r} requested but CUDA is not available")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype)


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine (offline, colocated worker, P or D worker) needs."""

    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}")

    @classmethod
    def build(cls, model_dir: str | Path, *, block_size: int = 16, num_kv_blocks: int | None = None,
              memory_fraction: float = 0.2, max_num_seqs: int = 64, max_num_batched_tokens: int = 2048,
              max_model_len: int | None = None, enable_chunked_prefill: bool = True,
              enable_prefix_caching: bool = True, dtype: str = "float32", device: str = "cpu",
              num_threads: int | None = None, seed: int = 0) -> "EngineConfig":
        """Keyword options as users of `LLM(...)` and the CLI spell them."""
        model = ModelConfig.from_dir(model_dir)
        if max_model_len is None:
            max_model_len = min(model.max_position_embeddings, 4096)
        return cls(
            model=model,
            cache=CacheConfig(block_size=block_size, num_blocks=num_kv_blocks, memory_fraction=memory_fraction),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len, enable_chunked_prefill=enable_chunked_prefill,
                                      enable_prefix_caching=enable_prefix_caching),
            device=DeviceConfig(device=device, dtype=dtype, num_threads=num_threads),
            seed=seed,
        )


ROLES = ("prefill", "decode", "colocated")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: its role, identity, sockets and KV transfer settings."""

    role: str
    worker_id: str
    bind: str = "tcp://127.0.0.1:0"
    kv_transfer: str = "auto"  # auto | shm | cuda_ipc | gloo | nccl | tcp
    dist_init: str = ""  # torch.distributed init method for gloo/nccl, e.g. tcp://127.0.0.1:PORT
    rank: int = -1
    world_size: int = 0
    prefill_peers: tuple[str, ...] = ()  # decode role: prefill workers to handshake with at start
    report_to: str = ""  # router address to push WorkerStatus heartbeats to
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 30.0
    ready_file: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transfer in ("gloo", "nccl") and self.role != "colocated":
            if not self.dist_init or self.rank < 0 or self.world_size < 2:
                raise ConfigError(f"kv transfer {self.kv_transfer!r} needs dist_init, rank and world_size >= 2")
