"""The prefill worker's transfer plan for one engine step (an engine `KVWriter`): which
finished blocks of which job go to which decode blocks, written layer by layer during
the forward where the backend allows it (shm, CUDA IPC)."""
from __future__ import annotations

from pdserve.common.engine.engine import KVProgress
from pdserve.common.timeline import Stamp, mark
from pdserve.kv_transfer import KVSender
from pdserve.prefill_node.jobs import JobState, JobTable, PrefillJob


class LayerPush:
    """Owns one step's list of block copies; `commit` records them as pushed once the
    step has run (a failed step pushes nothing)."""

    def __init__(self, jobs: JobTable, senders: dict[str, KVSender], now: float) -> None:
        self.jobs = jobs
        self.now = now  # when the step began (the worker's clock): a job's PREFILL_START
        self.senders = senders
        self.copies: list[tuple[KVSender, list[int], list[int]]] = []  # (sender, src blocks, dst blocks)
        self.advanced: list[tuple[PrefillJob, int]] = []  # (job, blocks pushed after the step)
        self.scheduled: list[PrefillJob] = []

    def plan(self, progress: list[KVProgress]) -> bool:
        for p in progress:
            job = self.jobs.by_seq(p.seq.seq_id)
            assert job is not None, "the engine ran a sequence with no prefill job"
            self.scheduled.append(job)
            mark(job.timeline, Stamp.PREFILL_START, self.now, first=True)
            sender = self.senders[job.decode_id]
            lo, hi = job.pushed, p.complete_blocks
            if hi <= lo or not sender.layerwise or job.seq.sampling_params.max_tokens == 0:  # scored only: no KV
                continue
            src = job.seq.block_table[lo:hi]
            dst = job.dst_block_ids[lo - job.skip_blocks:hi - job.skip_blocks]
            self.copies.append((sender, src, dst))
            self.advanced.append((job, hi))
        return bool(self.copies)

    def write_layer(self, layer: int) -> None:
        for sender, src, dst in self.copies:
            sender.write_layer(layer, src, dst)

    def commit(self) -> None:
        for job, hi in self.advanced:
            job.pushed = hi
        for job in self.scheduled:
            if job.state == JobState.QUEUED:
                self.jobs.move(job, JobState.PREFILLING)
