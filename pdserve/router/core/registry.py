"""The router's view of its workers: registration, heartbeats with load, liveness, a
per-worker prefix index fed by KV events (block hashes stored / evicted), and each
worker's place in the pool's life cycle:

    serving --drain--> draining --nothing routed to it is left--> exiting --gone--> (retired)

Only serving workers are routed to. A draining worker keeps its requests (and a prefill
worker its pending hand-offs) until they end; an exiting one has been told to exit and is
no longer counted dead when it falls silent. A retired worker's id and address are
remembered for `retire_memory_s`, so a hello it sent before exiting cannot register it again."""
from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.common.engine.kv_layout import fingerprint_parts
from pdserve.common.wire.messages import WorkerHello, WorkerStatus
from pdserve.router.core.policy import WorkerView, prefix_overlap


SERVING, DRAINING, EXITING = "serving", "draining", "exiting"


class PoolError(ValueError):
    """A pool operation that cannot be done as asked; the text says why and what to do."""


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
    state: str = SERVING
    state_since: float = 0.0  # when it entered `state` (monotonic s)
    routed: int = 0  # requests routed to it (each attempt counts)

    def take(self) -> None:
        """One more request routed to it."""
        self.inflight += 1
        self.routed += 1

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

    def __init__(self, stale_after_s: float = 3.0, retire_memory_s: float = 30.0) -> None:
        self.stale_after_s = stale_after_s
        self.retire_memory_s = retire_memory_s
        self.workers: dict[str, WorkerEntry] = {}
        self.retired: dict[str, tuple[str, float]] = {}  # worker id -> (address, until when it is remembered)

    def ignores(self, msg: WorkerHello, now: float) -> bool:
        """Whether `msg` is a retired worker's own late hello (same id, same address)."""
        address, until = self.retired.get(msg.worker_id, ("", 0.0))
        return address == msg.address and now < until

    def hello(self, msg: WorkerHello, now: float) -> WorkerEntry | None:
        """Register (or refresh) a worker; None for a retired worker's own late hello."""
        if self.ignores(msg, now):
            return None
        entry = self.workers.get(msg.worker_id)
        if entry is None or entry.hello.address != msg.address:  # new, or restarted elsewhere
            entry = self.workers[msg.worker_id] = WorkerEntry(msg, now, state_since=now)
            self.retired.pop(msg.worker_id, None)
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
        """Take workers whose heartbeats stopped out of rotation; returns the newly dead
        (an exiting worker's silence is its exit: `exited_silently` reports it)."""
        dead = []
        for e in self.workers.values():
            if e.alive and e.state != EXITING and now - e.last_seen > self.stale_after_s:
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
        """The workers requests may be routed to: alive and serving."""
        return [e for e in self.workers.values() if e.alive and e.state == SERVING and e.role in roles]

    # ---- the pool life cycle ---------------------------------------------------------------
    def can_serve_without(self, entries: list[WorkerEntry]) -> bool:
        """Whether the serving workers other than `entries` can still serve a request
        (a prefill and a decode worker, or a colocated one)."""
        gone = {e.worker_id for e in entries}
        left = {r: [e for e in self.live((r,)) if e.worker_id not in gone] for r in ("prefill", "decode", "colocated")}
        return bool((left["prefill"] and left["decode"]) or left["colocated"])

    def serving_entry(self, worker_id: str) -> WorkerEntry:
        """The serving worker `worker_id`; PoolError if there is none of that id."""
        entry = self.workers.get(worker_id)
        if entry is None:
            known = ", ".join(sorted(self.workers)) or "none"
            raise PoolError(f"no worker {worker_id!r} is registered (workers: {known})")
        if entry.state != SERVING or not entry.alive:
            raise PoolError(f"worker {worker_id} is {entry.state if entry.alive else 'dead'}, not serving")
        return entry

    def drain(self, entry: WorkerEntry, now: float) -> None:
        """Stop routing to `entry` (a serving worker)."""
        entry.state, entry.state_since = DRAINING, now

    def ready_to_exit(self, now: float) -> list[WorkerEntry]:
        """Draining workers with nothing routed to them left, now `exiting`: the caller
        tells each to exit. A draining worker that died is left to `expire` (its
        requests are re-routed as any dead worker's)."""
        out = []
        for e in self.workers.values():
            if e.state == DRAINING and e.alive and e.inflight == 0:
                e.state, e.state_since = EXITING, now
                out.append(e)
        return out

    def exited_silently(self, now: float) -> list[WorkerEntry]:
        """Exiting workers silent for `stale_after_s`: gone (the caller retires them)."""
        return [e for e in self.workers.values() if e.state == EXITING and now - e.last_seen > self.stale_after_s]

    def retire(self, entry: WorkerEntry, now: float) -> None:
        """Forget a worker that left the pool; a hello from its old address is ignored for
        `retire_memory_s`, a new process (another address) registers afresh."""
        self.workers.pop(entry.worker_id, None)
        self.retired = {w: v for w, v in self.retired.items() if v[1] > now}
        self.retired[entry.worker_id] = (entry.hello.address, now + self.retire_memory_s)

    def pool_counts(self) -> dict[tuple[str, str], int]:
        """(role, state) -> how many workers; dead ones under state "dead"."""
        counts: dict[tuple[str, str], int] = {}
        for e in self.workers.values():
            key = (e.role, e.state if e.alive else "dead")
            counts[key] = counts.get(key, 0) + 1
        return counts

    def live_except(self, role: str, avoid: frozenset[str]) -> list[WorkerEntry]:
        """The live workers of `role` not in `avoid`; all live ones if only those are left."""
        entries = self.live((role,))
        return [e for e in entries if e.worker_id not in avoid] or entries

    def views(self, entries: list[WorkerEntry], prompt_hashes: list[int] | None = None,
              queued_blocks: dict[str, int] | None = None) -> list[WorkerView]:
        """What the routing policy sees of `entries`; `queued_blocks`: worker id -> prompt
        blocks it has been sent to compute and has not (the router's count)."""
        out = []
        for e in entries:
            total = e.status.total_blocks if e.status else e.hello.total_blocks
            free = e.status.free_blocks if e.status else total
            overlap = prefix_overlap(prompt_hashes, e.cached) if prompt_hashes else 0
            queued = queued_blocks.get(e.worker_id, 0) if queued_blocks else 0
            out.append(WorkerView(e.worker_id, e.inflight, free, total, overlap, queued))
        return out
