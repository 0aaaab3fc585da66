"""The router's frozen configuration; socket addresses derive from it in one place."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ConfigError
from router.policy import POLICIES


@dataclass(frozen=True)
class RouterConfig:
    """Where the router listens and how it routes."""

    model_dir: str
    model_name: str = "pdserve"
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
    # fault tolerance (docs/reliability.md)
    retries: int = 2  # a request whose worker failed is re-routed up to this many times
    restart_workers: bool = False  # the launcher starts a worker again when it exits
    client_timeout_s: float = 10.0  # a ZeroMQ client that heartbeats and then falls silent this long is gone

    def __post_init__(self) -> None:
        if self.routing not in POLICIES:
            raise ConfigError(f"routing {self.routing!r} is not one of {', '.join(POLICIES)}")
        if self.retries < 0:
            raise ConfigError(f"retries must be >= 0, got {self.retries}")
        if not self.stale_after_s > 0 or not self.client_timeout_s > 0:
            raise ConfigError("stale_after_s and client_timeout_s must be > 0 seconds")
        for name in ("http_port", "zmq_port", "control_port"):
            if not 0 <= getattr(self, name) < 65536:
                raise ConfigError(f"{name} must be a port number, got {getattr(self, name)}")

    def zmq_address(self) -> str:
        return f"tcp://{self.host}:{self.zmq_port}"

    def control_address(self) -> str:
        return f"tcp://{self.host}:{self.control_port}"
