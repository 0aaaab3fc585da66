"""The prefill worker: batches (and chunks) prompts on its own device with its own block
manager and prefix cache, writes each finished prompt's KV into the blocks its decode
worker reserved, samples the first token and reports it with KVReady.

Job states and their transitions: prefill_node/jobs.py; the per-step transfer plan:
prefill_node/kv_push.py."""
from __future__ import annotations

import os

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.config import EngineConfig, WorkerConfig
from pdserve.common.engine.engine import LLMEngine, RequestError, StepOutput
from pdserve.common.worker.faults import Faults
from pdserve.common.worker.host import cross_host_refusal, same_host
from pdserve.common.worker.liveness import process_alive
from pdserve.common.wire.messages import (AbortRequest, ErrorReply, KVHandshake, KVHandshakeReply, KVReady, PrefillFailed,
                             PrefillRequest, StatusRequest)
from pdserve.common.timeline import Stamp, mark
from pdserve.common.wire.transport import Incoming
from pdserve.common.worker.base import WorkerBase
from pdserve.kv_transfer import (KVSender, TransferError, check_block_ids, check_peer_info, init_transfer_group,
                         layout_mismatch, make_sender, resolve_backend)
from pdserve.kv_transfer.integrity import kv_checksum
from pdserve.prefill_node.jobs import JobState, JobTable, PrefillJob
from pdserve.prefill_node.kv_push import LayerPush


class PrefillWorker(WorkerBase):
    """Owns the prefill-only engine, the senders to its decode peers and the job table."""

    role = "prefill"

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(engine_config, worker_config, clock)
        self.backend = resolve_backend(worker_config.kv_transfer, engine_config.device.device)
        self.engine = LLMEngine(engine_config, prefill_only=True, warm_up=True)
        self.senders: dict[str, KVSender] = {}  # decode_id -> sender
        self.peer_blocks: dict[str, int] = {}  # decode_id -> blocks in its cache (bounds every write)
        self.jobs = JobTable()
        self.counters.update(blocks_sent=0, bytes_sent=0, prefills=0, prefix_hit_tokens=0, decode_peers_lost=0)
        self.decode_peers: dict[str, tuple[int, str]] = {}  # decode_id -> (pid, host) from its handshake
        self.decode_seen: dict[str, float] = {}  # decode_id -> when it last sent anything (monotonic s)
        self._next_peer_check = 0.0
        init_transfer_group(worker_config, engine_config.device.device)
        Faults.from_env(self.worker_id).wrap_prefill(self)

    # ---- messages ----------------------------------------------------------------------
    def handle(self, inc: Incoming) -> None:
        msg = inc.msg
        self.decode_seen[inc.identity.decode(errors="replace")] = self.clock.monotonic()  # D's identity is its id
        if isinstance(msg, KVHandshake):
            self.on_handshake(inc.identity, msg)
        elif isinstance(msg, PrefillRequest):
            self.on_prefill(inc.identity, msg)
        elif isinstance(msg, StatusRequest):
            self.server.send(inc.identity, self.status())
        elif isinstance(msg, AbortRequest):
            jobs = self.jobs.find_request(msg.request_id)
            for job in jobs:
                self.end(job, JobState.ABORTED, "aborted")
            if not jobs:  # done or never here: still fence the sender, whose blocks wait on our word
                self.server.send(inc.identity, PrefillFailed(msg.request_id, "no such prefill job (done or unknown)"))
        else:
            self.server.send(inc.identity, ErrorReply("", f"a prefill worker does not take {msg.TYPE!r} messages"))

    def on_handshake(self, identity: bytes, hs: KVHandshake) -> None:
        """Accept a decode worker (the message is authentic: it is of this deployment)
        whose cache is the one the deployment gives it and whose layout matches ours."""
        if identity != hs.decode_id.encode():
            self.log(f"refused a handshake naming decode worker {hs.decode_id!r} from connection {identity!r}")
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, "decode_id does not match the "
                                                        "connection's identity", self.layout))
            return
        mismatch = layout_mismatch(self.layout, hs.layout)
        if hs.backend != self.backend:
            mismatch = (mismatch + "; " if mismatch else "") + \
                f"kv transfer backend: prefill uses {self.backend!r}, decode uses {hs.backend!r}"
        elif why := cross_host_refusal(self.backend, self.host_id, hs.backend_info.get("host")):
            mismatch = (mismatch + "; " if mismatch else "") + why
        if mismatch:
            self.log(f"refused decode worker {hs.decode_id}: {mismatch}")
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, f"incompatible prefill/decode pair: {mismatch}", self.layout))
            return
        try:
            num_blocks = check_peer_info(self.backend, hs.backend_info, hs.layout, hs.decode_id,
                                         self.key.deployment_id, self.wconfig.world_size, self.wconfig.rank)
        except TransferError as e:
            self.log(f"refused decode worker {hs.decode_id}: {e}")
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, f"refused: {e}", self.layout))
            return
        try:
            old = self.senders.pop(hs.decode_id, None)
            if old:
                old.close()
            self.senders[hs.decode_id] = make_sender(self.backend, self.engine.runner.kv_cache, hs.backend_info)
            self.peer_blocks[hs.decode_id] = num_blocks
        except Exception as e:  # e.g. the shm segment cannot be mapped
            self.server.send(identity, KVHandshakeReply(self.worker_id, False, f"cannot reach decode cache: {e}", self.layout))
            return
        pid, host = hs.backend_info.get("pid", 0), hs.backend_info.get("host", "")
        self.decode_peers[hs.decode_id] = (pid if isinstance(pid, int) else 0, host if isinstance(host, str) else "")
        info = dict(self.dist_info(), pid=os.getpid(), host=self.host_id)
        self.server.send(identity, KVHandshakeReply(self.worker_id, True, "", self.layout, info))

    def on_prefill(self, identity: bytes, req: PrefillRequest) -> None:
        now = self.clock.time()
        try:
            # only the decode worker that handshook on this connection writes into its own blocks
            if req.decode_id not in self.senders or identity != req.decode_id.encode():
                raise RequestError(f"decode worker {req.decode_id!r} has not completed a handshake on this connection")
            if self.jobs.find_request(req.request_id):
                raise RequestError(f"request id {req.request_id!r} is already being prefilled")
            seq = self.engine.new_sequence(req.prompt_token_ids, req.sampling, req.block_hashes)
            n_blocks = -(-len(seq) // self.engine.config.cache.block_size)
            if not 0 <= req.skip_blocks < n_blocks or len(req.dst_block_ids) != n_blocks - req.skip_blocks:
                raise RequestError(f"reservation of {len(req.dst_block_ids)} blocks after skipping "
                                   f"{req.skip_blocks} does not cover a {len(seq)}-token prompt ({n_blocks} blocks)")
            why = check_block_ids(req.dst_block_ids, self.peer_blocks[req.decode_id])
            if why:
                raise RequestError(f"reservation refused: {why}")
        except RequestError as e:
            self.log(f"prefill request {req.request_id!r} from {req.decode_id!r} refused: {e}")
            self.server.send(identity, PrefillFailed(req.request_id, str(e)))
            return
        job = PrefillJob(req.request_id, seq, identity, req.decode_id, req.skip_blocks, req.dst_block_ids,
                         pushed=req.skip_blocks, timeline=dict(req.timeline))
        mark(job.timeline, Stamp.PREFILL_QUEUED, now)
        self.jobs.add(job)
        self.engine.add(seq)

    # ---- the step ----------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        push = LayerPush(self.jobs, self.senders, self.clock.time())
        outputs = self.engine.step(push)
        push.commit()
        end = self.clock.time()
        for out in outputs:
            job = self.jobs.by_seq(out.seq.seq_id)
            assert job is not None, "the engine ran a sequence with no prefill job"
            if out.error is not None:  # this prompt alone broke the step: its D fails it, the rest go on
                self.end(job, JobState.FAILED, out.error)
            else:
                self.hand_off(job, out, end)

    def hand_off(self, job: PrefillJob, out: StepOutput, prefill_end: float) -> None:
        """The prompt is computed: send the KV D still lacks, then KVReady with the first
        token -- or, for a request that samples none (max_tokens 0: it was scored), no KV,
        KVReady with first_token -1 and its prompt logprobs."""
        seq = job.seq
        scored = out.new_token < 0
        n_blocks = 0 if scored else len(job.dst_block_ids)
        sender = self.senders[job.decode_id]
        mark(job.timeline, Stamp.PREFILL_END, prefill_end)
        mark(job.timeline, Stamp.TRANSFER_START, self.clock.time())
        ready = KVReady(job.request_id, out.new_token, n_blocks, timeline=job.timeline,
                        sampler_state=self.engine.sampler_state(seq), first_logprobs=out.logprobs,
                        fork_tokens=[f.new_token for f in out.forks], prompt_logprobs=out.prompt_logprobs)
        if out.forks and ready.sampler_state:  # n > 1: each choice's first token and generator, one KV
            ready.fork_sampler_states = [self.engine.sampler_state(f.seq) for f in out.forks]
        if out.forks and out.logprobs is not None:
            ready.fork_logprobs = [f.logprobs for f in out.forks if f.logprobs is not None]
        src = seq.block_table[job.skip_blocks:]
        try:
            frames = [] if sender.layerwise or scored else sender.send(ready, src, job.dst_block_ids)
            if self.wconfig.verify_transfers and not scored:
                ready.checksum = kv_checksum(self.engine.runner.kv_cache, src)
        except Exception as e:  # e.g. the process group broke: this job fails, the worker goes on
            self.log(f"request {job.request_id}: KV send failed: {e}")
            self.end(job, JobState.FAILED, f"KV send failed: {e}")
            return
        mark(job.timeline, Stamp.TRANSFER_END, self.clock.time())
        self.server.send(job.identity, ready, frames)
        self.counters["blocks_sent"] += n_blocks
        self.counters["bytes_sent"] = sum(s.bytes_sent for s in self.senders.values())
        self.counters["prefills"] += 1
        self.counters["prefix_hit_tokens"] += seq.num_cached_tokens
        self.engine.release(seq, "prefilled")
        self.jobs.move(job, JobState.SENT)

    def end(self, job: PrefillJob, state: JobState, reason: str) -> None:
        """Fail or abort a job: release its sequence; tell its decode worker why."""
        self.engine.release(job.seq, "abort")
        self.jobs.move(job, state)
        self.server.send(job.identity, PrefillFailed(job.request_id, reason))

    def idle(self) -> None:
        for s in self.senders.values():
            s.poll()
        now = self.clock.monotonic()
        if now >= self._next_peer_check:
            self._next_peer_check = now + min(1.0, self.wconfig.peer_timeout_s / 4)
            self.check_decode_peers(now)

    def check_decode_peers(self, now: float) -> None:
        """P's side of the lease: a decode worker that is gone (its process exited, or,
        on another host, silent past peer_timeout_s -- it pings every quarter of it) will
        never take what we hold for it: its jobs end and its sender is closed (for shm:
        its segment is unmapped)."""
        for decode_id in list(self.senders):
            pid, host = self.decode_peers.get(decode_id, (0, ""))
            if same_host(self.host_id, host) and pid > 0:  # a pid only means something on its own host
                gone = not process_alive(pid)
            else:
                gone = now - self.decode_seen.get(decode_id, now) > self.wconfig.peer_timeout_s
            if not gone:
                continue
            jobs = self.jobs.for_decode(decode_id)
            self.log(f"decode worker {decode_id} is gone: dropping its {len(jobs)} job(s) and its sender")
            for job in jobs:
                self.engine.release(job.seq, "abort")
                self.jobs.move(job, JobState.ABORTED)
            self.senders.pop(decode_id).close()
            self.decode_peers.pop(decode_id, None)
            self.counters["decode_peers_lost"] += 1

    def drained(self) -> bool:
        return len(self.jobs) == 0

    def load(self) -> tuple[int, int]:
        s = self.engine.scheduler
        return len(s.waiting), len(s.running)

    def close(self) -> None:
        for s in self.senders.values():
            s.close()
        super().close()


def serve(engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
    PrefillWorker(engine_config, worker_config).run()
