"""The router's frozen configuration; socket addresses derive from it in one place."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from router.policy import POLICIES


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens, how it routes, and the client-facing limits
    (docs/security.md, "Client-facing edge")."""

    model_dir: str
    model_name: str = "pdserve"
    dtype: str = "float32"  # the deployment's engine dtype (resolved, never "auto"): part of the model fingerprint
    host: str = "127.0.0.1"
    http_port: int = 8000  # 0 picks a free port
    zmq_port: int = 5555  # client front end; 0 picks a free port
    control_port: int = 0  # worker hello/heartbeats
    routing: str = "prefix_load"
    max_model_len: int = 2048
    block_size: int = 16
    stale_after_s: float = 5.0
    seed: int = 0
    enable_http: bool = True
    # admission: requests being prepared or in flight (queued on a worker included);
    # above it a new one is refused (HTTP 429 + Retry-After, ZeroMQ error "overloaded")
    max_inflight: int = 256
    retry_after_s: int = 1
    max_prompt_chars: int = 0  # checked before tokenizing; 0: default_prompt_chars(max_model_len)
    max_body_bytes: int = 16 * 1024 * 1024  # HTTP request body, however it is sent (chunked too)
    api_key: str | None = None  # HTTP: required as "Authorization: Bearer <key>" on /v1/*
    tokenizer_threads: int = 2  # chat template + tokenization run here, off the event loop
    # fault tolerance (docs/reliability.md)
    retries: int = 2  # a request whose worker failed is re-routed up to this many times
    restart_workers: bool = False  # the launcher starts a worker again when it exits
    client_timeout_s: float = 10.0  # a ZeroMQ client that heartbeats and then falls silent this long is gone

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be the deployment's resolved engine dtype (float32, bfloat16 or float16), "
                              f"got {self.dtype!r}")
        if self.routing not in POLICIES:
            raise ConfigError(f"routing {self.routing!r} is not one of {', '.join(POLICIES)}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if not self.stale_after_s > 0 or not self.client_timeout_s > 0:
            raise ConfigError("stale_after_s and client_timeout_s must be > 0 seconds")
        for name in ("http_port", "zmq_port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be a port number, got {getattr(self, name)}")
        for name in ("max_inflight", "retry_after_s", "max_body_bytes", "tokenizer_threads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prompt_chars < 0:
            raise ConfigError(f"max_prompt_chars must be >= 0 (0: default), got {self.max_prompt_chars}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty (leave it out to serve without one)")

    @property
    def prompt_chars_limit(self) -> int:
        return self.max_prompt_chars or default_prompt_chars(self.max_model_len)

    def zmq_address(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    def control_address(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"


def default_prompt_chars(max_model_len: int) -> int:
    """16 characters per token of context (a token averages ~4), at least 64 Ki: generous
    for any prompt that can fit, while bounding tokenization to ~0.1 s per request."""
    return max(64 * 1024, 16 * max_model_len)
