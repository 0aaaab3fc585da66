"""Frozen configuration objects: one per concern, composed into EngineConfig.

The CLI and the offline `LLM` fill these; everything downstream trusts them, so all
validation of user-supplied values happens here, at the edge.
"""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.rope_config import RopeConfig

# The names other parts choose from, defined once (CLI choices, validation, launcher).
SUPPORTED_ARCHS = ("qwen3", "qwen2", "llama")
ROLES = ("prefill", "decode", "colocated")
BACKENDS = ("shm", "cuda_ipc", "gloo", "nccl", "tcp")  # KV transfer backends
KV_TRANSFER_CHOICES = ("auto", *BACKENDS)  # `auto`: cuda_ipc on GPU, shm on CPU
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
    decode_graphs: bool = False  # decode steps through bucketed static buffers (CUDA graphs on GPU)

    def __post_init__(self) -> None:
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}")

    @classmethod
    def build(cls, model_dir: str | Path, **options: Any) -> "EngineConfig":
        """Keyword options as users of `LLM(...)` and the CLI spell them (EngineOptions'
        fields: block_size, num_kv_blocks, max_model_len, dtype, device, ...)."""
        return EngineOptions(**options).engine_config(model_dir)


@dataclass(frozen=True)
class EngineOptions:
    """An engine's settings without the model: what the CLI, `LLM(...)` and a worker's
    config file give. `engine_config(model_dir)` reads the model and validates them."""

    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from memory_fraction
    memory_fraction: float = 0.2
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's max_position_embeddings, at most 4096
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    dtype: str = "float32"
    device: str = "cpu"
    num_threads: int | None = None
    seed: int = 0
    decode_graphs: bool = False  # decode steps through bucketed static buffers (CUDA graphs on GPU)

    def engine_config(self, model_dir: str | Path) -> EngineConfig:
        model = ModelConfig.from_dir(model_dir)
        from common.checkpoint_dtype import resolve_dtype  # it reads this module's helpers
        max_model_len = self.max_model_len
        if max_model_len is None:
            max_model_len = min(model.max_position_embeddings, 4096)
        return EngineConfig(
            model=model,
            cache=CacheConfig(block_size=self.block_size, num_blocks=self.num_kv_blocks,
                              memory_fraction=self.memory_fraction),
            scheduler=SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                                      max_model_len=max_model_len, enable_chunked_prefill=self.enable_chunked_prefill,
                                      enable_prefix_caching=self.enable_prefix_caching),
            device=DeviceConfig(device=self.device, dtype=resolve_dtype(self.dtype, model.model_dir, self.device),
                                num_threads=self.num_threads),
            seed=self.seed,
            decode_graphs=self.decode_graphs,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> "EngineOptions":
        return from_dict(cls, data, "engine options")


@dataclass(frozen=True)
class WorkerConfig:
    """One worker process: its role, identity, sockets and KV transfer settings."""

    role: str
    worker_id: str
    bind: str = "tcp://127.0.0.1:0"
    kv_transfer: str = "auto"  # one of KV_TRANSFER_CHOICES
    dist_init: str = ""  # torch.distributed init method for gloo/nccl, e.g. tcp://127.0.0.1:PORT
    rank: int = -1
    world_size: int = 0
    prefill_peers: tuple[str, ...] = ()  # decode role: prefill workers to handshake with at start
    report_to: str = ""  # router address to push WorkerStatus heartbeats to
    heartbeat_s: float = 0.5
    peer_timeout_s: float = 10.0  # a silent peer (or an unanswered handshake) is lost after this
    ready_file: str = ""
    # the deployment's secret (hex, common.wire.auth): only ever in the 0600 config file, never argv/env
    secret: str = field(default="", repr=False)
    # fault tolerance (docs/reliability.md)
    router_pid: int = 0  # the router's process; this worker exits when it is gone (0: not watched)
    router_timeout_s: float = 3.0  # how often the router is checked; the worker stops within this
    lease_s: float = 30.0  # decode: a reservation whose KV has not landed by then is given up
    drain_s: float = 10.0  # SIGTERM: how long running requests may finish before the worker exits
    verify_transfers: bool = False  # KVReady carries a checksum of the sent KV; D checks it

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transfer not in KV_TRANSFER_CHOICES:
            raise ConfigError(f"kv_transfer must be one of {KV_TRANSFER_CHOICES}, got {self.kv_transfer!r}")
        if self.kv_transfer in ("gloo", "nccl") and self.role != "colocated":
            if not self.dist_init or self.rank < 0 or self.world_size < 2:
                raise ConfigError(f"kv transfer {self.kv_transfer!r} needs dist_init, rank and world_size >= 2")
        for name in ("heartbeat_s", "peer_timeout_s", "router_timeout_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> "WorkerConfig":
        return from_dict(cls, data, "worker config")


# ---- plain-data (JSON) form of the frozen configs ------------------------------------------

_T = typing.TypeVar("_T")


def from_dict(cls: type[_T], data: object, where: str) -> _T:
    """An instance of the frozen dataclass `cls` from a JSON object, checked as input:
    unknown, missing or mistyped fields raise ConfigError naming the field, and the
    dataclass's own validation runs as for any other construction."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a JSON object, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))}")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}: missing field(s) {', '.join(map(repr, missing))}")
    hints = typing.get_type_hints(cls)
    values = {name: _check_type(value, hints[name], f"{where} field {name!r}") for name, value in data.items()}
    return cls(**values)


def _check_type(value: object, tp: object, where: str) -> object:
    """`value` as type `tp` (int, float, str, bool, X | None, tuple[str, ...]), or ConfigError."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        (tp,) = [a for a in args if a is not type(None)]
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        return tuple(_check_type(v, item, f"{where} item") for v in value)
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}[tp]  # type: ignore[index]
    if not ok(value):
        raise ConfigError(f"{where} must be {tp.__name__}, got {value!r}")  # type: ignore[union-attr]
    return float(value) if tp is float else value  # type: ignore[arg-type]
