"""Frozen configuration objects: one per concern, composed into EngineConfig.

The CLI and the offline `LLM` fill these; everything downstream trusts them, so all
validation of user-supplied values happens here, at the edge.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from pdserve.common import schema
from pdserve.common.checkpoint_dtype import resolve_dtype
from pdserve.common.config_base import DTYPES, ConfigError, dtype_name, parse_dtype, read_json
from pdserve.common.quantization import QUANTIZATIONS, resolve_quantization
from pdserve.common.rope_config import RopeConfig, parse_rope
from pdserve.common.speculative_config import MAX_SPECULATIVE_TOKENS as MAX_SPECULATIVE_TOKENS  # re-exported
from pdserve.common.speculative_config import SPECULATIVE_METHODS as SPECULATIVE_METHODS  # re-exported
from pdserve.common.speculative_config import SpeculativeConfig as SpeculativeConfig  # re-exported

if TYPE_CHECKING:  # torch is imported where a config is used to compute, not to validate (the router)
    import torch


def _cuda_available() -> bool:
    import torch
    return torch.cuda.is_available()


# The names other parts choose from, defined once (CLI choices, validation, launcher).
SUPPORTED_ARCHS = ("qwen3", "qwen2", "llama")
ROLES = ("prefill", "decode", "colocated")
BACKENDS = ("shm", "cuda_ipc", "gloo", "nccl", "tcp")  # KV transfer backends
KV_TRANSFER_CHOICES = ("auto", *BACKENDS)  # `auto`: cuda_ipc on GPU, shm on CPU
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
        if value is not None and value not in DTYPES:
            raise ConfigError(f"{cfg_path}: {key} {value!r} is not supported (choose from {sorted(set(DTYPES))})")


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


def option(default: Any, help: str) -> Any:
    """A config field with a default and the help text the CLI shows for it: each engine
    option's default and help are written once, here in its config."""
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry. `num_kv_blocks=None` sizes the cache from `memory_fraction`."""

    block_size: int = option(16, "tokens per KV cache block (a power of two); router and workers share it")
    num_kv_blocks: int | None = option(None, "KV cache size in blocks (default: sized by memory_fraction)")
    memory_fraction: float = option(0.2, "share of the device's free memory (the host's RAM on CPU) for the KV "
                                         "cache, when num_kv_blocks is not given")

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ConfigError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if not 0.0 < self.memory_fraction <= 0.95:
            raise ConfigError(f"memory_fraction must be in (0, 0.95], got {self.memory_fraction}")


# max_model_len left unset: the model's own limit, but no more than this, so a model made
# for 32k-128k contexts does not size its KV need and graph buffers for them by default
MAX_MODEL_LEN_CAP = 4096


@dataclass(frozen=True)
class SchedulerConfig:
    """Batching limits. `max_num_batched_tokens` is the per-step token budget.
    `max_model_len=None` is resolved against the model by EngineConfig."""

    max_num_seqs: int = option(64, "sequences batched at once")
    max_num_batched_tokens: int = option(2048, "token budget of one step, prefill chunks and decodes together")
    max_model_len: int | None = option(None, "longest sequence, prompt and output, in tokens "
                                             f"(default: the model's max_position_embeddings, at most {MAX_MODEL_LEN_CAP})")
    enable_chunked_prefill: bool = option(True, "split long prompts over steps within the token budget")
    enable_prefix_caching: bool = option(True, "reuse the KV of prompt prefixes already computed")

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"{name} must be >= 1, got {value}")
        if (not self.enable_chunked_prefill and self.max_model_len is not None
                and self.max_num_batched_tokens < self.max_model_len):
            raise ConfigError(
                f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) "
                f"must be >= max_model_len ({self.max_model_len})")


@dataclass(frozen=True)
class DeviceConfig:
    """Where and in what precision the model runs. Whether the device exists is checked
    where the engine is built (EngineConfig), not here: a router plans workers for GPUs
    it may not have itself."""

    device: str = option("cpu", "cpu, cuda or cuda:i")
    dtype: str = option("auto", "auto: the checkpoint's config.json dtype, as vLLM (a float32 checkpoint "
                                "stays float32; float16 -> bfloat16 on the CPU); float32; bfloat16 (on the "
                                "CPU: bf16 weights and KV cache, float32 activations); float16")
    quantization: str = option("auto", "weight-only quantized linears on the CPU: none, int8, int4 (int8 lm_head), "
                                        "gguf (a GGUF model's Q8_0/Q4_0/Q4_1 linears kept as stored, Q4_K as int4, "
                                        "Q5_K/Q6_K/Q5_0/Q5_1/Q2_K/Q3_K/IQ4 re-quantized to int8), or auto: "
                                        "gguf for a model converted from a GGUF file, else none")
    num_threads: int | None = option(None, "torch intra-op threads per process (default: torch's own; "
                                           "`serve`: the CPU cores shared among the workers)")

    def __post_init__(self) -> None:
        if self.dtype != "auto":  # resolved against the checkpoint by EngineConfig
            dtype_name(self.dtype)
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ConfigError(f"device must be 'cpu' or 'cuda[:i]', got {self.device!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError(f"num_threads must be >= 1, got {self.num_threads}")

    @property
    def torch_dtype(self) -> "torch.dtype":
        return parse_dtype(self.dtype)


class Option(NamedTuple):
    """One config field as users spell it (`LLM(..., block_size=32)`, `--block-size 32`, a
    worker spec's "engine" object), with what the CLI shows for it."""

    name: str
    section: str  # an engine option's EngineOptions field holding it: cache, scheduler, device; "" for its own
    type: Any  # the field's type hint
    default: Any
    help: str


def options_of(cls: type, section: str = "") -> dict[str, Option]:
    """The fields of the config dataclass `cls` as options: name, type, default, help."""
    hints = typing.get_type_hints(cls)
    return {f.name: Option(f.name, section, hints[f.name], f.default, f.metadata.get("help", ""))
            for f in dataclasses.fields(cls)}


@dataclass(frozen=True)
class EngineOptions:
    """An engine's settings without the model: the per-concern configs plus the engine's
    own fields. Filled by the CLI, `LLM(...)` and a worker's config file, all through the
    flat option names (`options()`: each section's fields, by their own names);
    `engine_config(model_dir)` reads the model and resolves the rest."""

    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    seed: int = option(0, "the engine's random seed, for requests that bring none")
    decode_graphs: bool = option(False, "decode batches through the bucketed static buffers (CUDA graphs on a GPU; "
                                        "always on for a CUDA decode worker); on the CPU it only pads batches, "
                                        "for testing the bucketing")
    speculative_config: str | None = option(None, "speculative decoding on the decode side, as vLLM's JSON: "
                                                  '{"method": "ngram", "num_speculative_tokens": 4, '
                                                  '"prompt_lookup_max": 4, "prompt_lookup_min": 2} or {"method": '
                                                  '"draft_model", "model": "self", "quantization": "int4", '
                                                  '"num_speculative_tokens": 4} (docs/speculative.md; default: off)')

    def __post_init__(self) -> None:
        spec = self.speculative_config
        if isinstance(spec, dict):  # LLM(speculative_config={...}): kept in its flag's form, JSON text
            object.__setattr__(self, "speculative_config", json.dumps(spec))
        if spec is not None:  # checked here, at the edge: ConfigError now, not when an engine starts
            SpeculativeConfig.parse(spec)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: off)."""
        return None if self.speculative_config is None else SpeculativeConfig.parse(self.speculative_config)

    @staticmethod
    def options() -> dict[str, Option]:
        """Every option by its flat name, in declaration order."""
        return _options()

    @staticmethod
    def of(**options: Any) -> "EngineOptions":
        """From flat options (block_size=32, num_kv_blocks=64, dtype="bfloat16", ...);
        the rest keep their defaults. Each section validates its values."""
        known = _options()
        unknown = sorted(set(options) - set(known))
        if unknown:
            raise ConfigError(f"unknown engine option(s) {', '.join(map(repr, unknown))} "
                              f"(known: {', '.join(known)})")
        by_section: dict[str, dict[str, Any]] = {}
        for name, value in options.items():
            by_section.setdefault(known[name].section, {})[name] = value
        own = by_section.pop("", {})
        sections = _sections()
        return EngineOptions(**{name: sections[name](**values) for name, values in by_section.items()}, **own)

    def replace(self, **options: Any) -> "EngineOptions":
        """A copy with some flat options changed."""
        return EngineOptions.of(**{**self.to_dict(), **options})

    def to_dict(self) -> dict[str, Any]:
        """The flat form: every option by name (a worker spec's "engine" object)."""
        return {name: getattr(getattr(self, o.section) if o.section else self, name) for name, o in _options().items()}

    @staticmethod
    def from_dict(data: object, where: str = "engine") -> "EngineOptions":
        """From the flat form as input (JSON): names and types checked, naming the field."""
        return EngineOptions.of(**schema.check_fields(_option_slots(), data, where, ConfigError))

    def engine_config(self, model_dir: str | Path) -> "EngineConfig":
        model = ModelConfig.from_dir(model_dir)
        return EngineConfig(model=model, **{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineOptions)})


@functools.cache
def _sections() -> dict[str, type]:
    """EngineOptions' fields that are per-concern configs, by field name."""
    hints = typing.get_type_hints(EngineOptions)
    return {f.name: hints[f.name] for f in dataclasses.fields(EngineOptions) if dataclasses.is_dataclass(hints[f.name])}


@functools.cache
def _options() -> dict[str, Option]:
    out: dict[str, Option] = {}
    for section, cls in [*_sections().items(), ("", EngineOptions)]:
        for name, o in options_of(cls, section).items():
            if section == "" and name in _sections():
                continue
            # one name space: a flat name must say which field it sets
            assert name not in out, f"engine option {name!r} is defined twice"
            out[name] = o
    return out


@functools.cache
def _option_slots() -> dict[str, schema.Slot]:
    return {name: schema.slot(o.type, required=False) for name, o in _options().items()}


@dataclass(frozen=True, kw_only=True)
class EngineConfig(EngineOptions):
    """EngineOptions resolved against one model: everything one engine (offline,
    colocated worker, P or D worker) needs. `scheduler.max_model_len` is set here."""

    model: ModelConfig

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.device.dtype == "auto":
            dtype = resolve_dtype("auto", self.model.model_dir, self.device.device)
            object.__setattr__(self, "device", dataclasses.replace(self.device, dtype=dtype))
        quantization = resolve_quantization(self.device.quantization, self.model.model_dir, self.device.device)
        object.__setattr__(self, "device", dataclasses.replace(self.device, quantization=quantization))
        if self.scheduler.max_model_len is None:
            resolved = min(self.model.max_position_embeddings, MAX_MODEL_LEN_CAP)
            object.__setattr__(self, "scheduler", dataclasses.replace(self.scheduler, max_model_len=resolved))
        if self.scheduler.max_model_len > self.model.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.scheduler.max_model_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}")
        if self.device.device.startswith("cuda") and not _cuda_available():
            raise ConfigError(f"device {self.device.device!r} requested but CUDA is not available")

    @classmethod
    def build(cls, model_dir: str | Path, **options: Any) -> "EngineConfig":
        """From flat options as users of `LLM(...)` and the CLI spell them
        (EngineOptions.options(): block_size, num_kv_blocks, max_model_len, dtype, ...)."""
        return EngineOptions.of(**options).engine_config(model_dir)


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
    host_id: str = ""  # "same host" is decided by it (common/worker/host.py); "" = boot id + network namespace
    heartbeat_s: float = option(0.5, "worker heartbeat interval (s)")
    peer_timeout_s: float = option(10.0, "a prefill/decode peer silent this long (s), or a handshake unanswered, "
                                         "is lost (same host: its process is watched)")
    ready_file: str = ""
    # the deployment's secret (hex, common.wire.auth): only ever in the 0600 config file, never argv/env
    secret: str = field(default="", repr=False)
    curve: bool = False  # CurveZMQ on every socket (common/wire/curve.py): the same on every process of a deployment
    # fault tolerance (docs/reliability.md)
    # the router's process (same host); this worker exits when it is gone. 0: not watched
    # (a joined worker: it re-sends its hello every router_timeout_s until a router registers it)
    router_pid: int = 0
    # the process that owns this worker (its Ray actor, router/launch/ray_actor.py): the worker exits when
    # it is gone, and reaches its router as a joined worker does (pings, hello again after an outage)
    parent_pid: int = 0
    router_timeout_s: float = option(3.0, "how often (s) a worker checks its router; it exits within this "
                                          "after a router it watches by pid; a joined worker closes a silent "
                                          "connection to its router after this, and gives up the router's "
                                          "requests after this much more")
    rejoin_timeout_s: float = option(300.0, "how long (s) a joined worker waits for a router it cannot reach "
                                            "(a restarted one at the same address registers it) before it "
                                            "exits with code 3")
    lease_s: float = option(30.0, "a decode worker gives up a reservation whose KV has not landed after "
                                  "this long (s)")
    drain_s: float = option(10.0, "SIGTERM: how long (s) a worker's running requests may finish before it exits")
    verify_transfers: bool = option(False, "checksum every KV transfer: KVReady carries it, D checks it")

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.kv_transfer not in KV_TRANSFER_CHOICES:
            raise ConfigError(f"kv_transfer must be one of {KV_TRANSFER_CHOICES}, got {self.kv_transfer!r}")
        if self.kv_transfer in ("gloo", "nccl") and self.role != "colocated":
            if not self.dist_init or self.rank < 0 or self.world_size < 2:
                raise ConfigError(f"kv transfer {self.kv_transfer!r} needs dist_init, rank and world_size >= 2")
        for name in ("heartbeat_s", "peer_timeout_s", "router_timeout_s", "rejoin_timeout_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: object, where: str = "worker") -> "WorkerConfig":
        """From JSON as input: unknown, missing or mistyped fields raise ConfigError naming the field."""
        return schema.build(cls, data, where, ConfigError)

