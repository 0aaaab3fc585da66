"""The decode worker: reserves blocks for each request (the engine reuses its own
prefix-cached blocks), asks a prefill worker to fill the rest, and once the KV lands
decodes the sequence in its continuous batch, streaming tokens to the router (one
`StepOutputs` message per loop turn: decode_node/outbox.py). A request
that cannot get blocks waits in FIFO order; it is never dropped. A request with no
prefill worker named is computed here (that is all the colocated worker does).

Request states and their transitions: decode_node/requests.py. Prefill peers:
decode_node/peers.py."""
from __future__ import annotations

import os

import zmq

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.config import EngineConfig, WorkerConfig
from pdserve.common.engine.engine import LLMEngine, RequestError, StepOutput
from pdserve.common.logprobs import TokenLogprobs
from pdserve.common.worker.faults import Faults
from pdserve.common.wire.messages import (AbortRequest, ErrorReply, GenerateRequest, KVHandshake, KVReady, PrefillFailed,
                                  PrefillRequest, RequestOutput, StatusRequest, StepOutputs, WorkerStatus)
from pdserve.common.engine.model_runner import decide_num_blocks, kv_cache_shape
from pdserve.common.models.precision import kv_cache_dtype
from pdserve.common.timeline import Count, Stamp, count, mark
from pdserve.common.wire.transport import Incoming
from pdserve.common.worker.base import IDLE_WAIT_MS, WorkerBase
from pdserve.decode_node.outbox import Outbox
from pdserve.decode_node.peers import HandshakeError, PeerLost, PeerMessage, PrefillPeers
from pdserve.decode_node.requests import DecodeRequest, RequestTable, State
from pdserve.kv_transfer import KVReceiver, TransferError, init_transfer_group, make_receiver, resolve_backend, shm_name_hint
from pdserve.kv_transfer.integrity import kv_checksum


class DecodeWorker(WorkerBase):
    """Owns the decode engine, its KV receiver, the prefill peers, the request table and
    the outbox of the current loop turn."""

    role = "decode"

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        super().__init__(engine_config, worker_config, clock)
        self.receiver: KVReceiver | None = None
        self.backend = ""
        self.requests = RequestTable()
        self.outbox = Outbox()
        self.counters.update(blocks_received=0, blocks_reused=0, requests=0, finished=0, failed=0, leases_expired=0,
                             transfers_rejected=0)
        faults = Faults.from_env(self.worker_id)  # a bad PDSERVE_FAULTS fails before the cache exists
        self.engine = self.make_engine()
        self.peers = PrefillPeers(self.ctx, self.poller, self.worker_id, worker_config.peer_timeout_s,
                                  self.backend, self.key, clock, self.host_id)
        init_transfer_group(worker_config, engine_config.device.device)
        try:
            for address in worker_config.prefill_peers:
                self.peers.connect(address, self.handshake())
                self.peers.wait_ready(address)
            faults.wrap_decode(self)
        except BaseException:
            self.close()  # do not leave the shared KV segment behind
            raise

    def make_engine(self) -> LLMEngine:
        """The engine over a KV cache the transfer backend can reach."""
        dev = self.config.device
        self.backend = resolve_backend(self.wconfig.kv_transfer, dev.device)
        shape = kv_cache_shape(self.config, decide_num_blocks(self.config, speculates=True))
        self.receiver = make_receiver(self.backend, shape, kv_cache_dtype(dev), dev.device,
                                      shm_name_hint(self.worker_id, self.key.deployment_id))
        return LLMEngine(self.config, self.receiver.kv_cache, warm_up=True)

    def handshake(self) -> KVHandshake:
        assert self.receiver is not None
        return KVHandshake(self.worker_id, self.server.address, self.layout, self.backend,
                           dict(self.receiver.backend_info(), num_blocks=self.engine.block_manager.num_blocks,
                                **self.dist_info(), pid=os.getpid(),
                                host=self.host_id))  # P drops what it holds for us once we are gone

    # ---- messages from the router -------------------------------------------------------
    def handle(self, inc: Incoming) -> None:
        msg = inc.msg
        if isinstance(msg, GenerateRequest):
            self.on_generate(inc.identity, msg)
        elif isinstance(msg, AbortRequest):
            req = self.requests.get(msg.request_id)
            if req and msg.index >= 0 and len(req.choices) > 1:
                self.abort_choice(req, msg.index)
            elif req:
                self.abort(req)
        elif isinstance(msg, StatusRequest):
            self.server.send(inc.identity, self.status())
        else:
            self.server.send(inc.identity, ErrorReply("", f"a {self.role} worker does not take {msg.TYPE!r} messages"))

    def on_generate(self, identity: bytes, msg: GenerateRequest) -> None:
        now = self.clock.time()
        try:
            if self.draining_until is not None:
                self.server.send(identity, ErrorReply(msg.request_id, "decode worker is draining (SIGTERM)",
                                                      "worker_draining"))
                return
            if msg.request_id in self.requests:
                raise RequestError(f"request id {msg.request_id!r} is already in use")
            seq = self.engine.new_sequence(msg.prompt_token_ids, msg.sampling, msg.block_hashes)
            if msg.prefill_addr:
                self.check_prefill_addr(msg.prefill_addr)
        except (RequestError, HandshakeError) as e:
            self.server.send(identity, ErrorReply(msg.request_id, str(e)))
            return
        req = DecodeRequest(msg.request_id, seq, identity, msg.prefill_addr, msg.return_timeline, dict(msg.timeline))
        mark(req.timeline, Stamp.DECODE_ARRIVAL, now)
        self.requests.add(req)
        self.counters["requests"] += 1
        if req.local:  # computed here: the engine schedules its prefill with the batch
            mark(req.timeline, Stamp.PREFILL_QUEUED, now)
            self.engine.add(seq)
            self.requests.move(req, State.RUNNING)

    def check_prefill_addr(self, address: str) -> None:
        """Connect to a prefill worker named for the first time (HandshakeError if its
        address is unusable); requests for it stay PENDING until its handshake is answered."""
        self.peers.connect(address, self.handshake())

    # ---- reservations (PENDING -> RESERVED) ----------------------------------------------
    def try_reserve(self) -> None:
        for req in self.requests.in_state(State.PENDING):
            peer = self.peers.get(req.prefill_addr)
            if peer is None:  # its peer was dropped before it could be reserved
                self.fail(req, f"prefill worker at {req.prefill_addr} is not connected", code="worker_failed")
                continue
            if not peer.ready:
                continue  # its handshake is still in flight
            dst = self.engine.reserve(req.seq)
            if dst is None:
                return  # wait for blocks or a batch slot; FIFO, so nothing behind it jumps the queue
            self.requests.move(req, State.RESERVED)
            req.dst_blocks = dst
            req.lease_until = self.clock.monotonic() + self.wconfig.lease_s
            skip = len(req.seq.block_table) - len(dst)
            self.counters["blocks_reused"] += skip
            mark(req.timeline, Stamp.DECODE_RESERVED, self.clock.time())
            seq = req.seq
            peer.client.send(PrefillRequest(req.request_id, self.worker_id, seq.token_ids, seq.sampling_params,
                                            skip, dst, req.timeline, seq.prompt_hashes))

    # ---- messages from prefill peers -------------------------------------------------------
    def on_socket(self, sock: zmq.Socket) -> None:
        self.on_peer_events(self.peers.on_socket(sock))

    def on_peer_events(self, events: list) -> None:
        for event in events:
            if isinstance(event, PeerLost):
                self.on_peer_lost(event)
            elif isinstance(event, PeerMessage):
                msg = event.incoming.msg
                if isinstance(msg, KVReady):
                    self.on_kv_ready(event, msg)
                elif isinstance(msg, PrefillFailed):
                    self.on_prefill_failed(msg)

    def on_peer_lost(self, lost: PeerLost) -> None:
        """The peer writes nothing more: every request that waits on it ends now."""
        why = lost.why if not lost.was_ready else f"prefill worker at {lost.address} failed: {lost.why}"
        for req in self.requests.in_state(State.PENDING, State.RESERVED, State.RECEIVING, State.DRAINING):
            if req.prefill_addr == lost.address:
                self.fail(req, why, code="worker_failed")

    def on_prefill_failed(self, msg: PrefillFailed) -> None:
        req = self.requests.get(msg.request_id)
        if req is not None and req.state in (State.RESERVED, State.DRAINING):
            self.fail(req, f"prefill failed: {msg.message}")

    def on_kv_ready(self, event: PeerMessage, ready: KVReady) -> None:
        req = self.requests.get(ready.request_id)
        if req is None or req.state not in (State.RESERVED, State.DRAINING) or req.prefill_addr != event.peer.address \
                or req.transfer is not None:  # a second KVReady must not replace a receive in flight
            self.log(f"KVReady for unknown request {ready.request_id!r} ignored")
            return
        assert self.receiver is not None
        if ready.first_token < 0:  # scored (max_tokens 0): P sent no KV, only the prompt's logprobs
            self.kv_landed(req, ready)
            return
        try:
            pending = self.receiver.receive(ready, event.incoming.frames, req.dst_blocks, event.peer.info)
        except TransferError as e:
            self.fail(req, f"KV transfer rejected: {e}", code="transfer_error")
            return
        req.timeline.update({k: v for k, v in ready.timeline.items() if k not in req.timeline})
        if pending is None:
            self.kv_landed(req, ready)
            return
        req.transfer, req.ready = pending, ready  # its buffer lives until the receive completes
        if req.state == State.RESERVED:  # lands in poll_receives; the batch keeps decoding meanwhile
            self.requests.move(req, State.RECEIVING)

    def poll_receives(self) -> None:
        for req in self.requests.in_state(State.RECEIVING, State.DRAINING):
            if req.transfer is None or not req.transfer.done():
                continue
            transfer, ready, req.transfer, req.ready = req.transfer, req.ready, None, None
            if req.state == State.DRAINING or ready is None:
                self.end(req, State.ABORTED)
                continue
            try:
                transfer.land()
            except TransferError as e:
                self.fail(req, f"KV transfer failed: {e}", code="transfer_error")
                continue
            self.kv_landed(req, ready)

    def kv_landed(self, req: DecodeRequest, ready: KVReady) -> None:
        """The prompt's KV is in the reserved blocks: start decoding it."""
        if req.state == State.DRAINING:
            self.end(req, State.ABORTED)  # P is done writing: its blocks can go
            return
        if ready.checksum >= 0 and self.receiver is not None and \
                kv_checksum(self.receiver.kv_cache, req.dst_blocks) != ready.checksum:
            self.counters["transfers_rejected"] += 1
            self.fail(req, "KV transfer corrupt: checksum mismatch", code="transfer_error")  # never decoded
            return
        forks = _fork_firsts(ready, len(req.seq.forks))
        if forks is None:
            self.fail(req, f"KV ready carries {1 + len(ready.fork_tokens)} first tokens (with "
                      f"{len(ready.fork_sampler_states)} sampler states, {len(ready.fork_logprobs)} logprobs) "
                      f"for {len(req.choices)} choices", code="transfer_error")
            return
        self.counters["blocks_received"] += 0 if ready.first_token < 0 else len(req.dst_blocks)
        now = self.clock.time()
        mark(req.timeline, Stamp.KV_READY, now)
        mark(req.timeline, Stamp.FIRST_TOKEN, now)
        self.requests.move(req, State.RUNNING)
        outs = self.engine.start_decoding(req.seq, ready.first_token, ready.sampler_state, ready.first_logprobs, forks)
        outs[0].prompt_logprobs = ready.prompt_logprobs  # choice 0's first output carries the request's
        for out in outs:
            self.emit(req, out)

    # ---- the step --------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        start = self.clock.time()
        outputs = self.engine.step()
        now = self.clock.time()
        for seq in self.engine.scheduler.running:  # local prompts: when their prefill began
            req = self.requests.by_seq(seq.seq_id)
            if req is not None and req.local:
                mark(req.timeline, Stamp.PREFILL_START, start, first=True)
        for out in outputs:
            req = self.requests.by_seq(out.seq.seq_id)
            if req is None:  # a choice of a request that failed earlier in this loop (its other choice broke)
                assert out.seq.is_finished, "the engine ran a sequence the table does not hold"
                continue
            if out.error is not None:  # this request alone broke the step; the engine released it
                self.fail(req, out.error, code="internal_error")
                continue
            if req.local:
                mark(req.timeline, Stamp.PREFILL_START, start, first=True)
                mark(req.timeline, Stamp.PREFILL_END, now, first=True)
            mark(req.timeline, Stamp.FIRST_TOKEN, now, first=True)
            self.emit(req, out)

    def idle_wait_ms(self) -> int:
        return 1 if self.requests.count(State.RECEIVING, State.DRAINING) else IDLE_WAIT_MS  # a landed receive within 1 ms

    def idle(self) -> None:
        self.poll_receives()
        self.on_peer_events(self.peers.check())
        self.expire_leases()
        self.try_reserve()

    def expire_leases(self) -> None:
        """A reservation whose KV has not landed within lease_s (a lost, late or stuck
        transfer) is answered with transfer_timeout -- the router re-prefills it -- and
        waits in DRAINING, holding its blocks, until P is fenced: P answers the abort
        (PrefillFailed, or a KVReady that crossed it) or is lost."""
        now = self.clock.monotonic()
        for req in self.requests.in_state(State.RESERVED):
            if now < req.lease_until:
                continue
            self.counters["leases_expired"] += 1
            self.log(f"request {req.request_id}: lease of {self.wconfig.lease_s:g} s expired before its KV landed")
            self.reply(req.identity, ErrorReply(req.request_id, f"KV did not land within "
                                                f"{self.wconfig.lease_s:g} s", "transfer_timeout"))
            self.counters["failed"] += 1
            if (peer := self.peers.get(req.prefill_addr)) is not None:
                peer.client.send(AbortRequest(req.request_id))
            self.end(req, State.FAILED, fenced=False)

    def drained(self) -> bool:
        return len(self.requests) == 0

    def release_shared(self) -> None:
        if self.receiver is not None:
            self.receiver.close()  # unlinks the shm segment's name first

    def load(self) -> tuple[int, int]:
        waiting = len(self.engine.scheduler.waiting) + self.requests.count(State.PENDING)
        return waiting, len(self.engine.scheduler.running) + self.requests.count(State.RESERVED, State.RECEIVING)

    # ---- replies and exits -----------------------------------------------------------------
    def emit(self, req: DecodeRequest, out: StepOutput) -> None:
        """Queue a step's token (none: max_tokens 0) for this turn's message; a finished
        sequence has released its blocks in the engine, and a request whose every choice
        finished leaves."""
        tokens = [out.new_token] if out.new_token >= 0 else []
        if not out.finished:
            entry = RequestOutput(req.request_id, tokens, logprobs=_logprobs(out), index=out.seq.index,
                                  prompt_logprobs=out.prompt_logprobs, **_spec_counts(out))
            if out.seq.num_output_tokens == 1:  # the first: a request ended by a stop string gets no last entry
                entry.num_prompt_tokens, entry.num_cached_tokens = out.seq.num_prompt_tokens, out.seq.num_cached_tokens
            self.outbox.add(req.identity, entry)
            return
        self.finish_reply(req, out.seq.finish_reason or "stop", tokens, _logprobs(out), out.seq.index,
                          out.prompt_logprobs, **_spec_counts(out))
        self.finish_if_done(req)

    def finish_if_done(self, req: DecodeRequest) -> None:
        if len(req.answered) == len(req.choices):
            self.requests.move(req, State.FINISHED)
            self.counters["finished"] += 1

    def finish_reply(self, req: DecodeRequest, reason: str, new_tokens: list[int],
                     logprobs: list[TokenLogprobs] | None = None, index: int = 0,
                     prompt_logprobs: list[TokenLogprobs | None] | None = None,
                     num_draft_tokens: list[int] | None = None, num_accepted_tokens: list[int] | None = None) -> None:
        seq = req.seq
        req.answered.add(index)
        mark(req.timeline, Stamp.FINISH, self.clock.time())
        drafted = sum(c.num_draft_tokens for c in req.choices)
        if drafted:  # the request speculated here: its acceptance, every choice's
            count(req.timeline, Count.SPEC_DRAFT_TOKENS, drafted)
            count(req.timeline, Count.SPEC_ACCEPTED_TOKENS, sum(c.num_accepted_tokens for c in req.choices))
        self.outbox.add(req.identity, RequestOutput(
            req.request_id, list(new_tokens), finished=True, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            timeline=req.timeline if req.return_timeline else None, logprobs=logprobs, index=index,
            prompt_logprobs=prompt_logprobs, num_draft_tokens=num_draft_tokens or [],
            num_accepted_tokens=num_accepted_tokens or []))

    def flush(self) -> None:
        """End of a loop turn: one StepOutputs per router connection with every entry of
        the turn."""
        for identity, entries in self.outbox.take_all():
            self._send_outputs(identity, entries)

    def _send_outputs(self, identity: bytes, entries: list[RequestOutput]) -> None:
        if not entries:
            return
        self.server.send(identity, StepOutputs(entries))

    def reply(self, identity: bytes, msg: ErrorReply) -> None:
        """Send `msg` now, after what this turn already queued for the connection: a
        request's error never overtakes its tokens."""
        self._send_outputs(identity, self.outbox.take(identity))
        self.server.send(identity, msg)

    def fail(self, req: DecodeRequest, message: str, code: str = "bad_request") -> None:
        """Answer with an error (once) and end the request. Callers fail a request when its
        prefill worker can write nothing more (it answered, failed or is lost); a receive
        still in flight keeps it DRAINING."""
        if req.state != State.DRAINING:
            self.reply(req.identity, ErrorReply(req.request_id, message, code))
            self.counters["failed"] += 1
        self.end(req, State.FAILED)

    def abort(self, req: DecodeRequest) -> None:
        """The client went away: answer now; free the blocks once P cannot write them
        (P is told, and fences itself by answering PrefillFailed or KVReady)."""
        if req.state == State.DRAINING:
            return
        for choice in req.choices:
            if choice.index not in req.answered:
                self.finish_reply(req, "abort", [], index=choice.index)
        self.counters["finished"] += 1
        writing = req.state in (State.RESERVED, State.RECEIVING)
        if req.state == State.RESERVED and (peer := self.peers.get(req.prefill_addr)) is not None:
            peer.client.send(AbortRequest(req.request_id))
        self.end(req, State.ABORTED, fenced=not writing)

    def on_router_lost(self) -> int:
        """Every request here came from the router: each is aborted as if its client left
        (blocks freed once its prefill worker is fenced)."""
        live = list(self.requests.in_state(State.PENDING, State.RESERVED, State.RECEIVING, State.RUNNING))
        for req in live:
            self.abort(req)
        return len(live)

    def abort_choice(self, req: DecodeRequest, index: int) -> None:
        """One choice of a running request ends (the router matched a stop string in it):
        its sequence is released; the request goes on while other choices do."""
        if req.state != State.RUNNING or not 0 <= index < len(req.choices) or index in req.answered:
            return
        self.engine.release(req.choices[index], "abort")
        self.finish_reply(req, "abort", [], index=index)
        self.finish_if_done(req)

    def end(self, req: DecodeRequest, outcome: State, fenced: bool = True) -> None:
        """Release what `req` holds and leave the table in `outcome` -- unless a writer
        may still write into its memory: a prefill worker that was not fenced (it has not
        sent KVReady or PrefillFailed, and is not lost), or a receive in flight. Then it
        waits in DRAINING, already answered, holding its blocks (invariant: no block is
        reused while anything may write into it)."""
        if req.outcome is None:
            req.outcome = outcome
        if not fenced or (req.transfer is not None and not req.transfer.done()):
            if req.state != State.DRAINING:
                self.requests.move(req, State.DRAINING)
            return
        req.transfer = req.ready = None
        for choice in req.choices:
            self.engine.release(choice, "abort" if req.outcome == State.ABORTED else "error")
        self.requests.move(req, req.outcome)

    def close(self) -> None:
        if hasattr(self, "peers"):
            self.peers.close()
        if self.receiver:
            if hasattr(self, "engine"):
                del self.engine  # drop views of the shared cache before unmapping it
            self.receiver.close()
            self.receiver = None
        super().close()


def _logprobs(out: StepOutput) -> list[TokenLogprobs] | None:
    """A step output's logprobs as a `RequestOutput` holds them: one per token."""
    return None if out.logprobs is None else [out.logprobs]


def _spec_counts(out: StepOutput) -> dict[str, list[int]]:
    """A step output's speculative decoding counts as a `RequestOutput` holds them: one per
    verification (the last output of a verified sequence's step carries them)."""
    if not out.num_draft_tokens:
        return {}
    return {"num_draft_tokens": [out.num_draft_tokens], "num_accepted_tokens": [out.num_accepted_tokens]}


def _fork_firsts(ready: KVReady, n_forks: int) -> list[tuple[int, bytes, TokenLogprobs | None]] | None:
    """The first token, sampler state and logprobs of each fork that `ready` carries, or
    None if it does not carry one of each (as many as the request's other choices)."""
    states, lps = ready.fork_sampler_states, ready.fork_logprobs
    if len(ready.fork_tokens) != n_forks or len(states) not in (0, n_forks) or len(lps) not in (0, n_forks):
        return None
    return [(t, states[i] if states else b"", lps[i] if lps else None) for i, t in enumerate(ready.fork_tokens)]


__all__ = ["DecodeWorker", "HandshakeError", "WorkerStatus"]
