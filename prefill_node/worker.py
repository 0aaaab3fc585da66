"""The prefill worker: batches (and chunks) prompts on its own device with its own block
manager and prefix cache, writes each finished prompt's KV into the blocks its decode
worker reserved, samples the first token and reports it with KVReady."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass, field

from common.config import EngineConfig, WorkerConfig
from common.engine import LLMEngine, RequestError
from common.messages import (AbortRequest, ErrorReply, KVHandshake, KVHandshakeReply, KVReady,
                             PrefillFailed, PrefillRequest, StatusRequest)
from common.sampling_params import SamplingParamsError, from_wire
from common.sequence import Sequence
from common.transport import Incoming
from common.worker_base import WorkerBase
from kv_transfer import KVSender, init_transfer_group, layout_mismatch, make_sender, resolve_backend


@dataclass
class PrefillJob:
    """A prompt being prefilled for one decode worker, and how far its KV has been pushed."""

    request_id: str
    seq: Sequence
    identity: bytes  # the decode worker's connection on our server socket
    decode_id: str
    skip_blocks: int  # leading blocks D already has
    dst_block_ids: list[int]
    pushed: int = 0  # blocks [skip_blocks, pushed) are already in D's cache
    timeline: dict[str, float] = field(default_factory=dict)


class PrefillWorker(WorkerBase):
    """Owns the prefill engine, the senders to its decode peers and the jobs in flight."""

    role = "prefill"

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
        super().__init__(engine_config, worker_config)
        self.backend = resolve_backend(worker_config.kv_transfer, engine_config.device.device)
        self.engine = LLMEngine(engine_config)
        self.senders: dict[str, KVSender] = {}  # decode_id -> sender
        self.jobs: dict[int, PrefillJob] = {}  # seq_id -> job
        self.counters.update(blocks_sent=0, bytes_sent=0, prefills=0, prefix_hit_tokens=0)
        init_transfer_group(worker_config)

    # ---- messages ----------------------------------------------------------------
    def handle(self, inc: Incoming) -> None:
        msg = inc.msg
        if isinstance(msg, KVHandshake):
            self.on_handshake(inc.identity, msg)
        elif isinstance(msg, PrefillRequest):
            self.on_prefill(inc.identity, msg)
        elif isinstance(msg, StatusRequest):
            self.server.send(inc.identity, self.status())
        elif isinstance(msg, AbortRequest):
            for job in [j for j in self.jobs.values() if j.request_id == msg.request_id]:
                self.fail(job, "aborted")
        else:
            self.server.send(inc.identity, ErrorReply("", f"a prefill worker does not take {msg.TYPE!r} messages"))

    def on_handshake(self, identity: bytes, hs: KVHandshake) -> None:
        mismatch = layout_mismatch(self.layout, hs.layout)
        if hs.backend != self.backend:
            mismatch = (mismatch + "; " if mismatch else "") + \
                f"kv transfer backend: prefill uses {self.backend!r}, decode uses {hs.backend!r}"
        if mismatch:
            self.log(f"refused decode worker {hs.decode_id}: {mismatch}")
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, f"incompatible prefill/decode pair: {mismatch}", self.layout))
            return
        try:
            old = self.senders.pop(hs.decode_id, None)
            if old:
                old.close()
            self.senders[hs.decode_id] = make_sender(self.backend, self.engine.runner.kv_cache, hs.backend_info)
        except Exception as e:  # e.g. the shm segment cannot be mapped
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, f"cannot reach decode cache: {e}", self.layout))
            return
        info = dict(self.dist_info(), pid=os.getpid(), host=socket.gethostname())
        self.server.send(identity, KVHandshakeReply(self.worker_id, True, "", self.layout, info))

    def on_prefill(self, identity: bytes, req: PrefillRequest) -> None:
        now = time.time()
        sender = self.senders.get(req.decode_id)
        try:
            if sender is None:
                raise RequestError(f"decode worker {req.decode_id!r} has not completed a handshake")
            seq = self.engine.new_sequence(req.prompt_token_ids, from_wire(req.sampling))
            n_blocks = -(-len(seq) // self.engine.config.cache.block_size)
            if not 0 <= req.skip_blocks < n_blocks or len(req.dst_block_ids) != n_blocks - req.skip_blocks:
                raise RequestError(f"reservation of {len(req.dst_block_ids)} blocks after skipping "
                                   f"{req.skip_blocks} does not cover a {len(seq)}-token prompt ({n_blocks} blocks)")
        except (RequestError, SamplingParamsError) as e:
            self.server.send(identity, PrefillFailed(req.request_id, str(e)))
            return
        timeline = dict(req.timeline, prefill_queued=now)
        self.jobs[seq.seq_id] = PrefillJob(req.request_id, seq, identity, req.decode_id, req.skip_blocks,
                                           req.dst_block_ids, pushed=req.skip_blocks, timeline=timeline)
        self.engine.scheduler.add(seq)

    # ---- the step --------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        engine = self.engine
        bs = engine.config.cache.block_size
        batch = engine.scheduler.schedule()
        if not batch.seqs:
            return
        now = time.time()
        # KV blocks that become complete in this step and that D still lacks
        plans: list[tuple[PrefillJob, int, int]] = []
        for seq, n in zip(batch.seqs, batch.num_tokens):
            job = self.jobs[seq.seq_id]
            job.timeline.setdefault("prefill_start", now)
            end = seq.num_computed_tokens + n
            end_block = -(-end // bs) if end == len(seq) else end // bs
            if end_block > job.pushed:
                plans.append((job, job.pushed, end_block))
        layerwise = [(self.senders[j.decode_id], j.seq.block_table[lo:hi], j.dst_block_ids[lo - j.skip_blocks:hi - j.skip_blocks])
                     for j, lo, hi in plans if self.senders[j.decode_id].layerwise]

        def push_layer(layer: int) -> None:
            for sender, src, dst in layerwise:
                sender.write_layer(layer, src, dst)

        sampled = engine.runner.execute(batch, push_layer if layerwise else None)
        engine.scheduler.advance(batch)
        for job, _, hi in plans:
            if self.senders[job.decode_id].layerwise:
                job.pushed = hi
        end = time.time()
        for seq in batch.seqs:
            token = sampled.get(seq.seq_id)
            if token is not None:
                self.finish_job(self.jobs.pop(seq.seq_id), token, end)

    def finish_job(self, job: PrefillJob, first_token: int, prefill_end: float) -> None:
        seq = job.seq
        n_blocks = len(job.dst_block_ids)
        sender = self.senders[job.decode_id]
        job.timeline.update(prefill_end=prefill_end, transfer_start=time.time())
        ready = KVReady(job.request_id, first_token, n_blocks, timeline=job.timeline,
                        sampler_state=self.engine.runner.generator_state(seq.seq_id))
        frames = [] if sender.layerwise else sender.send(ready, seq.block_table[job.skip_blocks:], job.dst_block_ids)
        job.timeline["transfer_end"] = time.time()
        self.server.send(job.identity, ready, frames)
        self.counters["blocks_sent"] += n_blocks
        self.counters["bytes_sent"] = sum(s.bytes_sent for s in self.senders.values())
        self.counters["prefills"] += 1
        self.counters["prefix_hit_tokens"] += seq.num_cached_tokens
        self.engine.scheduler.finish(seq, "prefilled")
        self.engine.runner.release(seq.seq_id)

    def fail(self, job: PrefillJob, reason: str) -> None:
        self.jobs.pop(job.seq.seq_id, None)
        self.engine.scheduler.finish(job.seq, "abort")
        self.server.send(job.identity, PrefillFailed(job.request_id, reason))

    def idle(self) -> None:
        for s in self.senders.values():
            s.poll()

    def load(self) -> tuple[int, int]:
        s = self.engine.scheduler
        return len(s.waiting), len(s.running)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        super().close()


def serve(engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
    PrefillWorker(engine_config, worker_config).run()

