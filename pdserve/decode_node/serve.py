"""One decode-side worker process's entry: a decode worker, or a colocated one (the decode
worker that computes prompts itself), by the worker config's role."""
from __future__ import annotations

from pdserve.common.config import EngineConfig, WorkerConfig
from pdserve.decode_node.colocated import ColocatedWorker
from pdserve.decode_node.worker import DecodeWorker


def serve(engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
    """Run the worker until it is told to stop (or its router is lost)."""
    worker = ColocatedWorker if worker_config.role == "colocated" else DecodeWorker
    worker(engine_config, worker_config).run()
