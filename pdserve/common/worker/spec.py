"""What one worker process is started with, as data: the model directory, the engine
options and the worker config. The launcher writes it as a JSON file (mode 0600, in its
workdir) and starts `python -m pdserve.prefill_node --config FILE` or `python -m pdserve.decode_node
--config FILE`; the worker reads it back through the same validation as any input.

File format (version 1):

    {"version": 1, "model_dir": "/path/to/model",
     "engine": {EngineOptions' flat options: "block_size": 16, "num_kv_blocks": 256, ...},
     "worker": {WorkerConfig fields: "role": "decode", "worker_id": "decode-0", ...}}
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from pdserve.common.config import ConfigError, EngineConfig, EngineOptions, WorkerConfig
from pdserve.common.worker.router_link import EXIT_ROUTER_LOST, RouterLost

SPEC_VERSION = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything one worker process needs to start: model, engine options, worker config."""

    model_dir: str
    engine: EngineOptions
    worker: WorkerConfig

    def to_dict(self) -> dict[str, Any]:
        return {"version": SPEC_VERSION, "model_dir": self.model_dir, "engine": self.engine.to_dict(),
                "worker": self.worker.to_dict()}

    @classmethod
    def from_dict(cls, data: object) -> "WorkerSpec":
        if not isinstance(data, dict):
            raise ConfigError(f"a worker config file must hold a JSON object, got {type(data).__name__}")
        if data.get("version") != SPEC_VERSION:
            raise ConfigError(f"worker config file version {data.get('version')!r} is not {SPEC_VERSION}")
        unknown = sorted(set(data) - {"version", "model_dir", "engine", "worker"})
        if unknown:
            raise ConfigError(f"worker config file: unknown field(s) {', '.join(map(repr, unknown))}")
        model_dir = data.get("model_dir")
        if not isinstance(model_dir, str) or not model_dir:
            raise ConfigError(f"worker config file field 'model_dir' must be a non-empty string, got {model_dir!r}")
        return cls(model_dir, EngineOptions.from_dict(data.get("engine", {}), "engine"),
                   WorkerConfig.from_dict(data.get("worker"), "worker"))

    def write(self, path: str | Path) -> Path:
        """Write as JSON, readable by the owner only (it names sockets of the deployment)."""
        path = Path(path)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
        os.chmod(path, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        return path

    @classmethod
    def read(cls, path: str | Path) -> "WorkerSpec":
        try:
            data = json.loads(Path(path).read_text())
        except OSError as e:
            raise ConfigError(f"cannot read worker config file {path}: {e.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"worker config file {path} is not valid JSON: {e}") from None
        return cls.from_dict(data)

    @classmethod
    def of(cls, model_dir: str, role: str, worker_id: str, **options: Any) -> "WorkerSpec":
        """A spec from flat keyword options, each an engine option or a WorkerConfig field
        (block_size=32, kv_transfer="shm", peer_timeout_s=2.0, ...)."""
        engine_fields = set(EngineOptions.options())
        worker_fields = {f.name for f in dataclasses.fields(WorkerConfig)} - {"role", "worker_id"}
        unknown = sorted(set(options) - engine_fields - worker_fields)
        if unknown:
            raise ConfigError(f"unknown worker option(s) {', '.join(map(repr, unknown))}")
        engine = EngineOptions.of(**{k: v for k, v in options.items() if k in engine_fields})
        worker = WorkerConfig(role=role, worker_id=worker_id, **{k: v for k, v in options.items() if k in worker_fields})
        return cls(str(model_dir), engine, worker)

    def engine_config(self) -> EngineConfig:
        """The engine of this worker (`role_engine`)."""
        return role_engine(self.engine, self.worker.role).engine_config(self.model_dir)


def role_engine(engine: EngineOptions, role: str) -> EngineOptions:
    """The engine options a worker of `role` runs with: on a GPU, decode and colocated
    workers step their decode batches through the graph runner (CUDA graphs). On the CPU
    there is no graph to replay, and padding a batch to its bucket only adds rows to
    compute (a batch of 9 ran as 16), so the graph runner is used there only when asked
    for (`decode_graphs`, which the tests set to exercise the bucketing). `pdserve
    profile` times decode steps as a decode worker's."""
    on_gpu = engine.device.device.startswith("cuda")
    return dataclasses.replace(engine, decode_graphs=engine.decode_graphs or (on_gpu and role != "prefill"))


def worker_main(argv: list[str] | None, prog: str, roles: tuple[str, ...],
                serve: Callable[[EngineConfig, WorkerConfig], None]) -> int:
    """`python -m pdserve.prefill_node|decode_node --config FILE`: read the file, build the
    configs, and serve until stopped; a bad file (or a refusal at start-up) exits 2 with
    the reason on stderr."""
    parser = argparse.ArgumentParser(prog=prog, description=f"run one {' or '.join(roles)} worker")
    parser.add_argument("--config", required=True, help="worker config file (JSON, written by the launcher)")
    args = parser.parse_args(argv)
    try:
        spec = WorkerSpec.read(args.config)
        if spec.worker.role not in roles:
            raise ConfigError(f"{prog} runs role(s) {', '.join(roles)}; the config file asks for {spec.worker.role!r}")
        serve(spec.engine_config(), spec.worker)
    except (ConfigError, ValueError) as e:  # a bad config, or a peer that refused this one at start-up
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except RouterLost:  # the worker has logged why
        return EXIT_ROUTER_LOST
    return 0
