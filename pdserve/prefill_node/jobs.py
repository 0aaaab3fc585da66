"""The request state machine of a prefill worker: one table, every transition checked
in one place.

    QUEUED --first scheduled--> PREFILLING --first token, KV pushed, KVReady sent--> SENT
       |                            |
       +----------------------------+--> FAILED (PrefillFailed sent) / ABORTED (by its decode worker)

Every exit releases the job's sequence in the engine (its blocks and generator).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.common.engine.sequence import Sequence
from pdserve.common.timeline import Timeline


class JobState(enum.Enum):
    QUEUED = "queued"          # in the engine's queue; holds no blocks yet (or cached ones once admitted)
    PREFILLING = "prefilling"  # computing; holds its blocks; KV of finished blocks may already be in D
    SENT = "sent"              # terminal: KVReady sent, released
    FAILED = "failed"          # terminal: PrefillFailed sent, released
    ABORTED = "aborted"        # terminal: its decode worker aborted it, released


TERMINAL = frozenset({JobState.SENT, JobState.FAILED, JobState.ABORTED})

TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.PREFILLING, JobState.FAILED, JobState.ABORTED}),
    JobState.PREFILLING: frozenset({JobState.SENT, JobState.FAILED, JobState.ABORTED}),
}


@dataclass
class PrefillJob:
    """A prompt being prefilled for one decode worker, and how far its KV has been pushed."""

    request_id: str
    seq: Sequence
    identity: bytes  # the decode worker's connection on our server socket
    decode_id: str
    skip_blocks: int  # leading blocks D already has
    dst_block_ids: list[int]  # D's blocks for prompt blocks [skip_blocks, ...)
    pushed: int = 0  # blocks [skip_blocks, pushed) are already in D's cache
    timeline: Timeline = field(default_factory=dict)
    state: JobState = JobState.QUEUED


class JobTable:
    """Owns the live jobs, by sequence id (the engine's key) and by (decode id, request id)."""

    def __init__(self) -> None:
        self._by_seq: dict[int, PrefillJob] = {}

    def add(self, job: PrefillJob) -> None:
        assert job.state == JobState.QUEUED and job.seq.seq_id not in self._by_seq
        self._by_seq[job.seq.seq_id] = job

    def move(self, job: PrefillJob, state: JobState) -> None:
        if state not in TRANSITIONS.get(job.state, frozenset()):
            raise RuntimeError(f"prefill job {job.request_id}: {job.state.value} -> {state.value} is not allowed")
        job.state = state
        if state in TERMINAL:
            del self._by_seq[job.seq.seq_id]

    def by_seq(self, seq_id: int) -> PrefillJob | None:
        return self._by_seq.get(seq_id)

    def for_decode(self, decode_id: str) -> list[PrefillJob]:
        return [j for j in self._by_seq.values() if j.decode_id == decode_id]

    def find_request(self, request_id: str) -> list[PrefillJob]:
        return [j for j in self._by_seq.values() if j.request_id == request_id]

    def __len__(self) -> int:
        return len(self._by_seq)
