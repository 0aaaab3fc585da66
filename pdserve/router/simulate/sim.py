"""The discrete-event simulation: a heap of events on a virtual clock (a ManualClock,
the clock seam of common/clock.py), workers that are a real Scheduler + BlockManager
(common/engine) whose steps take what the latency model says, KV transfers priced by
blocks, and routing by the router's own code (router/simulate/routing.py).

A worker steps whenever its scheduler has work: the step's batch is the scheduler's,
its time is the prefill curve's price of each prompt chunk in it, the step's fixed cost
counted once (`step_seconds`), plus decode_step_s(decoding sequences, their mean
context) (less the decode fit's base where the step also has prompt chunks: one forward
streams the weights once), stretched where the deployment's workers share a host's
cores: with `host_cores` set, while `busy` workers of `threads` threads each are stepping,
every step progresses at 1 / max(1, busy * threads / host_cores) of its speed (processor
sharing: the rates change whenever a step starts or ends, as the OS shares the cores);
and where those threads fill the cores when a step starts, the host's other processes
(the router, a client on the host: `host_cpu_per_token_s` of CPU for each token the step
streams) take their CPU from the workers stepping then, in equal shares: each of their
steps, which wait for their slowest thread, grows by its share. A sequence whose tokens
are all computed after a step samples a token (its value is irrelevant; outputs run to
their trace length, as with ignore_eos).
A disaggregated request reserves its blocks on D when it arrives (FIFO, as the decode
worker does), is prefilled on P, and its KV moves once both are done; its first token
reaches the client when the KV lands on D. Heartbeats are instant: after every step the
router sees the worker's load, free blocks and prefix-cache events.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from pdserve.common.clock import ManualClock
from pdserve.common.config import SchedulerConfig
from pdserve.common.engine.block_manager import BlockManager
from pdserve.common.engine.scheduler import ScheduledBatch, Scheduler
from pdserve.common.engine.sequence import Sequence, SequenceStatus
from pdserve.common.hashing import block_hashes
from pdserve.common.sampling_params import SamplingParams
from pdserve.router.stats.latency import RequestRecord
from pdserve.router.core.config import RouterConfig
from pdserve.router.core.disagg_policy import Decision
from pdserve.common.latency_model import LatencyModel
from pdserve.router.core.registry import WorkerEntry
from pdserve.router.simulate.routing import SimRouter

SAMPLED_TOKEN = 1  # the value of every generated token
ARRIVE, STEP_DONE, KV_LANDED = 0, 1, 2


@dataclass(frozen=True)
class Deployment:
    """Workers per role and what each holds."""

    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    num_blocks: int = 4096
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    threads: int = 1     # torch threads per worker
    host_cores: int = 0  # the cores all workers share (0: each worker has its own)
    host_cpu_per_token_s: float = 0.0  # with host_cores: CPU of the router (and a client on the host) per token streamed

    def __post_init__(self) -> None:
        if min(self.prefill, self.decode, self.colocated, self.host_cores, self.host_cpu_per_token_s) < 0 \
                or self.num_blocks < 1:
            raise ValueError("worker counts, host_cores and host_cpu_per_token_s must be >= 0 and num_blocks >= 1")
        if self.threads < 1:
            raise ValueError("threads must be >= 1")
        if not (self.prefill and self.decode) and not self.colocated:
            raise ValueError("a deployment needs a prefill and a decode worker, or a colocated one")
        if self.colocated and (self.prefill or self.decode):
            raise ValueError("simulate either prefill + decode workers or colocated ones, not both")

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def label(self) -> str:
        return f"{self.colocated}C" if self.colocated else f"{self.prefill}P+{self.decode}D"


@dataclass(eq=False)
class SimRequest:
    """One request; also what the router's disaggregation reads of an InFlight."""

    request_id: str
    token_ids: list[int]
    output_len: int
    arrival: float
    block_hashes: list[int]
    record: RequestRecord
    timeline: dict[str, float] = field(default_factory=dict)
    decode: WorkerEntry | None = None
    prefill: WorkerEntry | None = None
    route: Decision | None = None
    prompt_blocks: int = 0  # the blocks of its prompt the worker computing it lacks (the router's queue count)
    first_token_at: float | None = None
    num_output_tokens: int = 0
    p_seq: Sequence | None = None
    d_seq: Sequence | None = None
    prefilled: bool = False
    reserved_blocks: int = -1  # blocks D lacks once reserved; -1 before

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.token_ids)


class SimWorker:
    """One worker: its engine's scheduler and block manager, and whether it is stepping."""

    def __init__(self, worker_id: str, role: str, dep: Deployment, block_size: int) -> None:
        self.worker_id, self.role = worker_id, role
        self.block_manager = BlockManager(dep.num_blocks, block_size, dep.scheduler.enable_prefix_caching)
        self.scheduler = Scheduler(dep.scheduler, self.block_manager)
        self.busy = False
        self.work = 0.0    # with host_cores: seconds of the step left at full speed, as of `since`
        self.rate = 1.0    # the speed it progresses at now (1 / the host's stretch)
        self.since = 0.0
        self.version = 0   # its latest STEP_DONE event; older ones are stale
        self.batch: ScheduledBatch | None = None
        self.pending: list[SimRequest] = []  # decode role: waiting for a reservation, FIFO
        self.reqs: dict[int, SimRequest] = {}  # seq id -> request
        self.steps = 0


class Simulation:
    """Runs requests through a deployment; `run` returns their records."""

    def __init__(self, dep: Deployment, model: LatencyModel, config: RouterConfig) -> None:
        self.dep, self.model, self.config = dep, model, config
        self.clock = ManualClock(start=0.0, epoch=0.0)
        self.router = SimRouter(config)
        self.workers: dict[str, SimWorker] = {}
        for role, n in (("prefill", dep.prefill), ("decode", dep.decode), ("colocated", dep.colocated)):
            for i in range(n):
                w = SimWorker(f"{role}-{i}", role, dep, config.block_size)
                self.workers[w.worker_id] = w
                self.router.register(w.worker_id, role, dep.num_blocks, 0.0)
        self._events: list[tuple[float, int, int, object]] = []
        self._order = itertools.count()
        self._seq_ids = itertools.count()

    # ---- the loop ----------------------------------------------------------------------
    def run(self, requests: list[tuple[float, list[int], int]]) -> list[SimRequest]:
        """`requests`: (arrival s, prompt token ids, output tokens). Runs until all are done."""
        reqs = []
        for i, (arrival, ids, out) in enumerate(requests):
            hashes = block_hashes(ids, self.config.block_size)
            r = SimRequest(f"r{i}", ids, max(1, out), arrival, hashes, RequestRecord(arrival, prompt_len=len(ids)))
            reqs.append(r)
            self._push(arrival, ARRIVE, r)
        handlers = {ARRIVE: self._arrive, STEP_DONE: self._step_done, KV_LANDED: self._kv_landed}
        while self._events:
            t, _, kind, obj = heapq.heappop(self._events)
            self.clock.advance(max(0.0, t - self.clock.monotonic()))
            handlers[kind](obj)
        return reqs

    @property
    def now(self) -> float:
        return self.clock.monotonic()

    def _push(self, t: float, kind: int, obj: object) -> None:
        heapq.heappush(self._events, (t, next(self._order), kind, obj))

    # ---- arrivals and routing ----------------------------------------------------------
    def _arrive(self, r: SimRequest) -> None:
        r.timeline["arrival"] = self.now
        if not self._fits(r):
            r.record.success, r.record.error = False, "prompt + output exceed a worker's KV cache"
            return
        r.decode, r.prefill, r.route, r.prompt_blocks = self.router.route(r)
        decode, prefill = r.decode, r.prefill
        self.router.inflight[r.request_id] = r
        decode.take()
        d = self.workers[decode.worker_id]
        if prefill is None:  # colocated, or prefilled on D
            r.d_seq = self._seq(r, r.output_len)
            self._queue(d, r, r.d_seq)
            return
        prefill.take()
        r.p_seq, r.d_seq = self._seq(r, 1), self._seq(r, r.output_len)
        self._queue(self.workers[prefill.worker_id], r, r.p_seq)
        d.pending.append(r)
        self._try_reserve(d)

    def _fits(self, r: SimRequest) -> bool:
        need = -(-(len(r.token_ids) + r.output_len) // self.config.block_size)
        return need <= self.dep.num_blocks

    def _seq(self, r: SimRequest, max_tokens: int) -> Sequence:
        return Sequence(next(self._seq_ids), list(r.token_ids), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                        prompt_hashes=list(r.block_hashes))

    def _queue(self, w: SimWorker, r: SimRequest, seq: Sequence) -> None:
        r.timeline.setdefault("prefill_queued", self.now)
        w.reqs[seq.seq_id] = r
        w.scheduler.add(seq)
        self._kick(w)

    def _try_reserve(self, d: SimWorker) -> None:
        while d.pending:
            r = d.pending[0]
            cached = d.scheduler.reserve(r.d_seq)
            if cached is None:
                return
            d.pending.pop(0)
            d.reqs[r.d_seq.seq_id] = r
            r.reserved_blocks = len(r.d_seq.block_table) - cached
            self._maybe_transfer(r)

    # ---- steps -------------------------------------------------------------------------
    def _kick(self, w: SimWorker) -> None:
        if w.busy or not w.scheduler.has_work():
            return
        batch = w.scheduler.schedule()
        while not batch.seqs and batch.preempted:  # it freed room: what waits may fit now
            batch = w.scheduler.schedule()
        if not batch.seqs:
            return
        w.busy, w.steps = True, w.steps + 1
        for seq in batch.seqs:
            w.reqs[seq.seq_id].timeline.setdefault("prefill_start", self.now)
        if not self.dep.host_cores:
            self._push(self.now + self.step_seconds(batch), STEP_DONE, (w, batch, w.version))
            return
        busy = [x for x in self.workers.values() if x.busy]  # this one included
        host = self.host_share(batch, len(busy) * self.dep.threads) / len(busy)
        w.work, w.since, w.batch, w.rate = self.step_seconds(batch) + host, self.now, batch, 0.0  # 0: no event yet
        for x in busy if host else ():
            if x is not w:
                self._bank(x)
                x.work += host
                self._push_end(x)
        self._rerate()

    def _bank(self, w: SimWorker) -> None:
        """Count the progress of `w`'s step since `since` at its rate."""
        w.work, w.since = max(0.0, w.work - (self.now - w.since) * w.rate), self.now

    def _push_end(self, w: SimWorker) -> None:
        w.version += 1
        self._push(self.now + w.work / w.rate, STEP_DONE, (w, w.batch, w.version))

    def _rerate(self) -> None:
        """The busy set changed: a stepping worker whose rate changes banks its progress so
        far and goes on at the new rate (processor sharing), its end event moved."""
        rate = 1.0 / self.contention(sum(w.busy for w in self.workers.values()) * self.dep.threads)
        for w in self.workers.values():
            if w.busy and w.rate != rate:
                self._bank(w)
                w.rate = rate
                self._push_end(w)

    def contention(self, threads: int) -> float:
        """How much slower a step runs while `threads` threads step on the host's cores."""
        return max(1.0, threads / self.dep.host_cores) if self.dep.host_cores else 1.0

    def host_share(self, batch: ScheduledBatch, threads: int) -> float:
        """Seconds the host's other processes take from the stepping workers while
        `threads` stepping threads fill the cores: their CPU for each token this step
        streams (0 where a core is free). `_kick` spreads it over the workers stepping
        then, in equal shares: the OS runs those processes on whichever busy core, and
        each step waits for its slowest thread."""
        if not (self.dep.host_cores and self.dep.host_cpu_per_token_s) or threads < self.dep.host_cores:
            return 0.0
        tokens = sum(seq.num_computed_tokens + n >= len(seq.token_ids) for seq, n in zip(batch.seqs, batch.num_tokens))
        return tokens * self.dep.host_cpu_per_token_s

    def step_seconds(self, batch: ScheduledBatch) -> float:
        """The prompts' chunks, each priced alone by the prefill curve, sharing one step's
        fixed cost (the curve at 0 tokens): prefill_s(0) + sum(prefill_s(n) - prefill_s(0));
        plus decode_step_s(decoding seqs, their mean context), less its base (the weights'
        stream, which the prompt chunks already pay) where the step has chunks too."""
        chunks, decodes, context = [], 0, 0
        for seq, n in zip(batch.seqs, batch.num_tokens):
            if n == 1 and seq.num_computed_tokens >= seq.num_prompt_tokens:
                decodes += 1
                context += seq.num_computed_tokens + 1
            else:
                chunks.append(n)
        step = 0.0
        if chunks:
            fixed = self.model.prefill(0)
            step = fixed + sum(max(0.0, self.model.prefill_s(n) - fixed) for n in chunks)
        if not decodes:
            return step
        decode = self.model.decode_step_s(decodes, context / decodes)
        # beside prompt chunks the decode rows ride the same forward: the weights stream once
        return step + (max(0.0, decode - self.model.decode.base_s) if chunks else decode)

    def _step_done(self, item: tuple[SimWorker, ScheduledBatch, int]) -> None:
        w, batch, version = item
        if version != w.version:  # the step's rate changed since this event was pushed
            return
        w.busy = False
        if self.dep.host_cores:
            self._rerate()
        w.scheduler.advance(batch)
        for seq in batch.seqs:
            if seq.num_computed_tokens == len(seq.token_ids) and seq.status == SequenceStatus.RUNNING:
                self._sampled(w, seq)
        self._heartbeat(w)
        if w.role == "decode":
            self._try_reserve(w)
        self._kick(w)

    def _sampled(self, w: SimWorker, seq: Sequence) -> None:
        r = w.reqs[seq.seq_id]
        if seq is r.p_seq:  # P sampled the first token: its KV goes to D
            w.scheduler.detach(seq)
            r.timeline["prefill_end"] = self.now
            r.prefilled = True
            self._maybe_transfer(r)
            return
        if seq.num_output_tokens == 0:
            r.timeline.setdefault("prefill_end", self.now)
        seq.token_ids.append(SAMPLED_TOKEN)
        self._token(w, r, seq)

    def _token(self, w: SimWorker, r: SimRequest, seq: Sequence) -> None:
        r.record.token_times.append(self.now)
        r.num_output_tokens += 1
        if r.first_token_at is None:
            r.first_token_at = r.timeline["first_token"] = self.now
            if r.prefill is not None:  # as the router: P's share of load ends with the first token
                r.prefill.inflight -= 1
        if seq.num_output_tokens >= r.output_len:
            w.scheduler.finish(seq, "length")
            del w.reqs[seq.seq_id]
            r.timeline["finish"] = self.now
            r.decode.inflight -= 1
            del self.router.inflight[r.request_id]

    def _heartbeat(self, w: SimWorker) -> None:
        bm = w.block_manager
        self.router.heartbeat(w.worker_id, w.role, len(w.scheduler.waiting), len(w.scheduler.running),
                              bm.num_free_blocks, bm.num_blocks, bm.take_events(), self.now)

    # ---- transfers ---------------------------------------------------------------------
    def _maybe_transfer(self, r: SimRequest) -> None:
        if r.prefilled and r.reserved_blocks >= 0:
            self._push(self.now + self.model.transfer_s(r.reserved_blocks), KV_LANDED, r)

    def _kv_landed(self, r: SimRequest) -> None:
        """P releases its copy; D starts decoding as LLMEngine.start_decoding does."""
        p = self.workers[r.prefill.worker_id]
        p.scheduler.finish(r.p_seq, "transferred")
        del p.reqs[r.p_seq.seq_id]
        self._heartbeat(p)
        self._kick(p)
        d, seq = self.workers[r.decode.worker_id], r.d_seq
        r.timeline["kv_ready"] = self.now
        seq.num_computed_tokens = len(seq)
        d.block_manager.cache_full_blocks(seq)
        seq.token_ids.append(SAMPLED_TOKEN)
        d.scheduler.start_running(seq)
        self._token(d, r, seq)
        self._kick(d)
