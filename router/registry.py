"""The router's view of its workers: registration, heartbeats with load, liveness, and a
per-worker prefix index fed by KV events (block hashes stored / evicted)."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.kv_layout import fingerprint_parts
from common.wire.messages import WorkerHello, WorkerStatus
from router.policy import WorkerView, prefix_overlap


@dataclass
class WorkerEntry:
    """Everything the router tracks for one worker."""

    hello: WorkerHello
    last_seen: float
    status: WorkerStatus | None = None
    cached: set[int] = field(default_factory=set)  # prefix index: block hashes it holds
    inflight: int = 0  # requests routed to it, not yet done with its phase
    alive: bool = True
    exited: bool = False  # the launcher saw its process exit: only a new hello brings it back

    @property
    def worker_id(self) -> str:
        return self.hello.worker_id

    @property
    def role(self) -> str:
        return self.hello.role


def refusal(hello: WorkerHello, block_size: int, model_fingerprint: str) -> str | None:
    """Why the router must not register this worker, or None. Prefix routing compares the
    router's block hashes with the worker's, so both need the router's block size and
    model (two models' hashes of one prompt are equal, their KV is not)."""
    diffs = []
    if hello.block_size != block_size:
        diffs.append(f"block_size {hello.block_size} (router: {block_size})")
    if hello.model_fingerprint != model_fingerprint:
        (theirs, their_dtype), (ours, our_dtype) = map(fingerprint_parts, (hello.model_fingerprint, model_fingerprint))
        if theirs == ours:  # the same weights in another precision (dtype[+quantization])
            dtype, _, quantization = our_dtype.partition("+")
            diffs.append(f"dtype {their_dtype or '?'} (router: {our_dtype or '?'}; start the worker with "
                         f"--dtype {dtype} --quantization {quantization or 'none'})")
        else:
            diffs.append(f"model fingerprint {hello.model_fingerprint!r} (router: {model_fingerprint!r})")
    if not diffs:
        return None
    return f"refused {hello.role} worker {hello.worker_id} at {hello.address}: it has {' and '.join(diffs)}"


class WorkerRegistry:
    """Owns the worker table. Time is passed in (monotonic seconds), never read here."""

    def __init__(self, stale_after_s: float = 3.0) -> None:
        self.stale_after_s = stale_after_s
        self.workers: dict[str, WorkerEntry] = {}

    def hello(self, msg: WorkerHello, now: float) -> WorkerEntry:
        entry = self.workers.get(msg.worker_id)
        if entry is None or entry.hello.address != msg.address:  # new, or restarted elsewhere
            entry = self.workers[msg.worker_id] = WorkerEntry(msg, now)
        entry.last_seen, entry.alive = now, True
        return entry

    def heartbeat(self, msg: WorkerStatus, now: float) -> WorkerEntry | None:
        entry = self.workers.get(msg.worker_id)
        if entry is None or entry.exited:
            return None  # heartbeat before hello (or a late one from an exited process): ignored
        entry.status, entry.last_seen, entry.alive = msg, now, True
        entry.cached.update(msg.kv_stored)
        entry.cached.difference_update(msg.kv_evicted)
        return entry

    def expire(self, now: float) -> list[WorkerEntry]:
        """Take workers whose heartbeats stopped out of rotation; returns the newly dead."""
        dead = []
        for e in self.workers.values():
            if e.alive and now - e.last_seen > self.stale_after_s:
                e.alive = False
                e.cached.clear()
                dead.append(e)
        return dead

    def mark_dead(self, entry: WorkerEntry) -> bool:
        """Its process exited: out of rotation at once; True if it was alive until now."""
        was_alive, entry.alive, entry.exited = entry.alive, False, True
        entry.cached.clear()
        return was_alive

    def live(self, roles: tuple[str, ...]) -> list[WorkerEntry]:
        return [e for e in self.workers.values() if e.alive and e.role in roles]

    def views(self, entries: list[WorkerEntry], prompt_hashes: list[int] | None = None) -> list[WorkerView]:
        out = []
        for e in entries:
            total = e.status.total_blocks if e.status else e.hello.total_blocks
            free = e.status.free_blocks if e.status else total
            overlap = prefix_overlap(prompt_hashes, e.cached) if prompt_hashes else 0
            out.append(WorkerView(e.worker_id, e.inflight, free, total, overlap))
        return out
