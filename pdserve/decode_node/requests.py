"""The request state machine of a decode (or colocated) worker: one table, every
transition checked in one place. The table is the single source of truth for where a
request is; what a state holds is stated next to it.

    PENDING --reserve--> RESERVED --KVReady--> RECEIVING --landed--> RUNNING --> FINISHED
       |                  |   \\_______________KVReady, landed at once___/ |
       |                  +--> FAILED (P fenced)                        +--> FAILED / ABORTED
       |    RESERVED / RECEIVING --(abort, or fail while a write may come)--> DRAINING --fenced--> ABORTED / FAILED
       +--> FAILED / ABORTED
    local prompt (no prefill worker):  PENDING --queued in the engine--> RUNNING
"""
from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

from pdserve.common.wire.messages import KVReady
from pdserve.common.engine.sequence import Sequence
from pdserve.common.timeline import Timeline
from pdserve.kv_transfer import PendingReceive


class State(enum.Enum):
    PENDING = "pending"      # holds nothing; waits (FIFO) for blocks, or its prefill peer's handshake
    RESERVED = "reserved"    # holds its blocks; P was asked to fill them (P may be writing)
    RECEIVING = "receiving"  # holds its blocks and a receive in flight (gloo/nccl)
    RUNNING = "running"      # in the engine's batch (a local prompt: also its prefill)
    DRAINING = "draining"    # answered (aborted/failed) but holds its blocks until the writer is fenced
    FINISHED = "finished"    # terminal: released
    FAILED = "failed"        # terminal: released
    ABORTED = "aborted"      # terminal: released


TERMINAL = frozenset({State.FINISHED, State.FAILED, State.ABORTED})

TRANSITIONS: dict[State, frozenset[State]] = {
    State.PENDING: frozenset({State.RESERVED, State.RUNNING, State.FAILED, State.ABORTED}),
    State.RESERVED: frozenset({State.RECEIVING, State.RUNNING, State.DRAINING, State.FAILED}),
    State.RECEIVING: frozenset({State.RUNNING, State.DRAINING, State.FAILED}),
    State.RUNNING: frozenset({State.FINISHED, State.FAILED, State.ABORTED}),
    State.DRAINING: frozenset({State.FAILED, State.ABORTED}),
}


class TransitionError(RuntimeError):
    """A transition the table does not allow: a bug in the worker, not bad input."""


@dataclass
class DecodeRequest:
    """A client request on this worker: its sequence, where its tokens go, its state and
    what that state holds (`dst_blocks` while reserved, `transfer` while receiving)."""

    request_id: str
    seq: Sequence
    identity: bytes  # the router connection its replies go to
    prefill_addr: str  # "" when the prompt is computed here
    return_timeline: bool
    timeline: Timeline = field(default_factory=dict)
    state: State = State.PENDING
    dst_blocks: list[int] = field(default_factory=list)  # blocks P fills (RESERVED, RECEIVING, DRAINING)
    transfer: PendingReceive | None = None  # RECEIVING, or DRAINING after RECEIVING
    ready: KVReady | None = None  # RECEIVING: the first token and sampler state wait with the data
    outcome: State | None = None  # DRAINING: the terminal state it ends in
    lease_until: float = 0.0  # RESERVED: monotonic time its KV must have landed by (WorkerConfig.lease_s)
    # every choice (n > 1): `seq` (choice 0, which the prompt is computed for) and its forks, which
    # take the prompt's blocks once it is computed; the request is finished when all are answered
    choices: list[Sequence] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)  # choices whose last entry has been queued

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [self.seq, *self.seq.forks]

    @property
    def local(self) -> bool:
        return not self.prefill_addr


class RequestTable:
    """Owns every live request of a worker, by id and by the sequence id of each of its
    choices; terminal requests
    leave the table. `move` is the only place a request changes state."""

    def __init__(self) -> None:
        self._by_id: dict[str, DecodeRequest] = {}
        self._by_seq: dict[int, DecodeRequest] = {}

    def add(self, req: DecodeRequest) -> None:
        assert req.request_id not in self._by_id and req.state == State.PENDING
        self._by_id[req.request_id] = req
        for seq in req.choices:
            self._by_seq[seq.seq_id] = req

    def move(self, req: DecodeRequest, state: State) -> None:
        if state not in TRANSITIONS.get(req.state, frozenset()):
            raise TransitionError(f"request {req.request_id}: {req.state.value} -> {state.value} is not allowed")
        req.state = state
        if state in TERMINAL:
            del self._by_id[req.request_id]
            for seq in req.choices:
                del self._by_seq[seq.seq_id]

    def get(self, request_id: str) -> DecodeRequest | None:
        return self._by_id.get(request_id)

    def by_seq(self, seq_id: int) -> DecodeRequest | None:
        return self._by_seq.get(seq_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def __len__(self) -> int:
        return len(self._by_id)

    def in_state(self, *states: State) -> Iterator[DecodeRequest]:
        """Requests in any of `states`, in arrival order (dicts keep insertion order)."""
        return iter([r for r in self._by_id.values() if r.state in states])

    def count(self, *states: State) -> int:
        return sum(1 for r in self._by_id.values() if r.state in states)
