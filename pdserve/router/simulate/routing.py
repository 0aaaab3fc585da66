"""The router's own routing, without its sockets: `Router.route` (router/core/router.py) runs
on a stand-in that holds exactly the state it reads -- a real WorkerRegistry fed real
WorkerHello / WorkerStatus messages, the real Disaggregation (router/core/disagg_state.py)
and its metrics, the config, the rng and the round-robin counters. The router's
constructor binds sockets and loads a tokenizer, so the simulator does not build one."""
from __future__ import annotations

import itertools
import random

from pdserve.common.wire.messages import WorkerHello, WorkerStatus
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.router import Router
from pdserve.router.core.disagg_state import Disaggregation
from pdserve.router.core.metrics import RouterMetrics
from pdserve.router.core.registry import WorkerEntry, WorkerRegistry


class SimRouter:
    """The state `Router.route` reads, and that method itself."""

    route = Router.route
    _note_routed = Router._note_routed
    _queued_blocks = Router._queued_blocks

    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.registry = WorkerRegistry(stale_after_s=float("inf"))
        self.metrics = RouterMetrics(config.model_name)
        self.rng = random.Random(config.seed)
        self.disagg = Disaggregation(config, self.metrics)
        self._rr_prefill = itertools.count()
        self._rr_decode = itertools.count()
        self.inflight: dict[str, object] = {}  # request id -> SimRequest (what disagg_case reads of InFlight)

    def register(self, worker_id: str, role: str, total_blocks: int, now: float) -> WorkerEntry:
        hello = WorkerHello(worker_id, role, f"sim://{worker_id}", "sim", total_blocks, self.config.block_size, "sim")
        entry = self.registry.hello(hello, now)
        assert entry is not None
        return entry

    def heartbeat(self, worker_id: str, role: str, waiting: int, running: int, free_blocks: int,
                  total_blocks: int, events: list[tuple[str, int]], now: float) -> None:
        """What a worker's heartbeat tells the router: load, free blocks, prefix-cache events."""
        stored = [h for kind, h in events if kind == "stored"]
        evicted = [h for kind, h in events if kind == "evicted"]
        self.registry.heartbeat(WorkerStatus(worker_id, role, waiting, running, free_blocks, total_blocks,
                                             kv_stored=stored, kv_evicted=evicted), now)
