"""The colocated worker: one process computes both phases of every request (chunked
prefill mixed into the decode batch). It is the decode worker with no prefill peers and
no transfer backend -- the A/B baseline of the SLO experiments."""
from __future__ import annotations

from pdserve.common.engine.engine import LLMEngine, RequestError
from pdserve.decode_node.worker import DecodeWorker


class ColocatedWorker(DecodeWorker):
    """Owns an engine over its own KV cache; every request is PENDING -> RUNNING here."""

    role = "colocated"

    def make_engine(self) -> LLMEngine:
        return LLMEngine(self.config, warm_up=True)

    def check_prefill_addr(self, address: str) -> None:
        raise RequestError("a colocated worker computes prompts itself; prefill_addr must be empty")
