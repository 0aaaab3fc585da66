"""The decode worker (and, with no prefill peer, the colocated worker): reserves blocks
for each request (reusing its own prefix-cached blocks), asks a prefill worker to fill
the rest, and on KVReady adds the sequence to its continuous batch and streams tokens.
A request that cannot get blocks waits in FIFO order; it is never dropped."""
from __future__ import annotations

import os
import re
import socket
import time
from collections import deque
from dataclasses import dataclass, field

import zmq

from common.config import ConfigError, EngineConfig, WorkerConfig
from common.engine import LLMEngine, RequestError
from common.messages import (AbortRequest, ErrorReply, GenerateRequest, KVHandshake, KVHandshakeReply,
                             KVReady, PrefillFailed, PrefillRequest, StatusRequest, TokenOutput, WorkerStatus)
from common.model_runner import decide_num_blocks, kv_cache_shape
from common.sampling_params import SamplingParamsError, from_wire
from common.sequence import Sequence
from common.transport import Client, Incoming
from common.worker_base import WorkerBase
from decode_node.graph_runner import GraphRunner
from kv_transfer import KVReceiver, PendingReceive, TransferError, init_transfer_group, make_receiver, resolve_backend


class HandshakeError(ConfigError):
    """A prefill worker refused this decode worker (incompatible KV layout or backend)."""


_ENDPOINT = re.compile(r"^(tcp://[^\s:]+:\d+|ipc://\S+|inproc://\S+)$")


@dataclass
class PrefillPeer:
    """A connection to one prefill worker; `ready` once it accepted our handshake."""

    address: str
    client: Client
    prefill_id: str
    info: dict
    last_seen: float
    last_ping: float = 0.0
    ready: bool = False
    deadline: float = 0.0  # handshake must be answered by then (monotonic seconds)


@dataclass
class Request:
    """A client request on this worker: its sequence and where its tokens go."""

    request_id: str
    seq: Sequence
    identity: bytes
    prefill_addr: str
    return_timeline: bool
    timeline: dict[str, float] = field(default_factory=dict)
    dst_blocks: list[int] = field(default_factory=list)
    aborted: bool = False


class DecodeWorker(WorkerBase):
    """Owns the decode engine, its KV receiver, the prefill peers and the request table."""

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
        super().__init__(engine_config, worker_config)
        self.role = worker_config.role
        dev = engine_config.device
        self.receiver: KVReceiver | None = None
        kv_cache = None
        if self.role == "decode":
            self.backend = resolve_backend(worker_config.kv_transfer, dev.device)
            shape = kv_cache_shape(engine_config, decide_num_blocks(engine_config))
            self.receiver = make_receiver(self.backend, shape, dev.torch_dtype, dev.device, self.worker_id)
            kv_cache = self.receiver.kv_cache
        self.engine = LLMEngine(engine_config, kv_cache)
        self.engine.runner = GraphRunner(self.engine.runner)
        self.peers: dict[str, PrefillPeer] = {}
        self.requests: dict[str, Request] = {}
        self.by_seq: dict[int, Request] = {}
        self.pending: deque[Request] = deque()  # waiting for blocks, FIFO
        self.awaiting_kv: dict[str, Request] = {}  # reserved blocks, KV not landed yet
        # receives in flight (gloo/nccl irecv), by request id; the request stays in
        # awaiting_kv until it lands. An entry outlives a request failed meanwhile: its
        # buffer must stay alive while the transfer may still write into it.
        self.receiving: dict[str, tuple[KVReady, PendingReceive]] = {}
        self.counters.update(blocks_received=0, blocks_reused=0, requests=0, finished=0, failed=0)
        self.last_refusal = ""
        init_transfer_group(worker_config)
        try:
            for address in worker_config.prefill_peers:
                self.connect(address)
        except BaseException:
            self.close()  # do not leave the shared KV segment behind
            raise

    # ---- prefill peers --------------------------------------------------------------
    def start_connect(self, address: str) -> PrefillPeer:
        """Send the handshake to a prefill worker; its reply is handled by the loop, so a
        slow or absent peer never stalls the running batch."""
        if address in self.peers:
            return self.peers[address]
        if not _ENDPOINT.match(address):
            raise HandshakeError(f"prefill address {address!r} is not a ZeroMQ endpoint (tcp://host:port or ipc://path)")
        assert self.receiver is not None
        try:
            client = Client(self.ctx, address, identity=self.worker_id.encode())
        except zmq.ZMQError as e:
            raise HandshakeError(f"cannot connect to prefill worker at {address}: {e}") from None
        client.send(KVHandshake(self.worker_id, self.server.address, self.layout, self.backend,
                                dict(self.receiver.backend_info(), **self.dist_info())))
        now = time.monotonic()
        peer = PrefillPeer(address, client, "", {}, now, deadline=now + self.wconfig.peer_timeout_s)
        self.peers[address] = peer
        self.poller.register(client.sock, zmq.POLLIN)
        return peer

    def connect(self, address: str) -> PrefillPeer:
        """Handshake and wait for the answer (start-up); HandshakeError if refused."""
        peer = self.start_connect(address)
        while not peer.ready:
            if not peer.client.sock.poll(50):
                if time.monotonic() > peer.deadline:
                    self.refuse(peer, f"prefill worker at {address} did not answer the handshake "
                                      f"within {self.wconfig.peer_timeout_s:.0f} s")
                continue
            self.on_socket(peer.client.sock)
            if address not in self.peers:
                raise HandshakeError(self.last_refusal)
        return peer

    def on_handshake_reply(self, peer: PrefillPeer, reply: KVHandshakeReply) -> None:
        if not reply.ok:
            self.refuse(peer, f"prefill worker at {peer.address} refused this decode worker: {reply.error}")
            return
        peer.ready, peer.prefill_id, peer.info = True, reply.prefill_id, reply.backend_info

    def refuse(self, peer: PrefillPeer, why: str) -> None:
        """A handshake failed: forget the peer, fail the requests that waited for it."""
        self.log(why)
        self.last_refusal = why
        self.poller.unregister(peer.client.sock)
        peer.client.close()
        del self.peers[peer.address]
        for req in [r for r in self.pending if r.prefill_addr == peer.address]:
            self.pending.remove(req)
            self.fail(req, why, code="worker_failed")

    def drop_peer(self, peer: PrefillPeer, why: str) -> None:
        self.log(f"dropping prefill worker {peer.prefill_id} at {peer.address}: {why}")
        self.poller.unregister(peer.client.sock)
        peer.client.close()
        del self.peers[peer.address]
        for req in [r for r in self.awaiting_kv.values() if r.prefill_addr == peer.address]:
            # a dead P writes nothing more, so its reserved blocks are safe to free
            self.fail(req, f"prefill worker {peer.prefill_id} failed: {why}", code="worker_failed")

    # ---- messages ------------------------------------------------------------------
    def handle(self, inc: Incoming) -> None:
        msg = inc.msg
        if isinstance(msg, GenerateRequest):
            self.on_generate(inc.identity, msg)
        elif isinstance(msg, AbortRequest):
            req = self.requests.get(msg.request_id)
            if req:
                self.abort(req)
        elif isinstance(msg, StatusRequest):
            self.server.send(inc.identity, self.status())
        else:
            self.server.send(inc.identity, ErrorReply("", f"a {self.role} worker does not take {msg.TYPE!r} messages"))

    def on_generate(self, identity: bytes, msg: GenerateRequest) -> None:
        now = time.time()
        try:
            if msg.request_id in self.requests:
                raise RequestError(f"request id {msg.request_id!r} is already in use")
            seq = self.engine.new_sequence(msg.prompt_token_ids, from_wire(msg.sampling))
            if msg.prefill_addr:
                if self.role != "decode":
                    raise RequestError("a colocated worker computes prompts itself; prefill_addr must be empty")
                self.start_connect(msg.prefill_addr)
        except (RequestError, SamplingParamsError, HandshakeError) as e:
            self.server.send(identity, ErrorReply(msg.request_id, str(e)))
            return
        req = Request(msg.request_id, seq, identity, msg.prefill_addr, msg.return_timeline,
                      dict(msg.timeline, decode_arrival=now))
        self.requests[req.request_id] = req
        self.by_seq[seq.seq_id] = req
        self.counters["requests"] += 1
        if msg.prefill_addr:
            self.pending.append(req)
        else:
            req.timeline["prefill_queued"] = now
            self.engine.scheduler.add(seq)

    def on_socket(self, sock: zmq.Socket) -> None:
        peer = next((p for p in self.peers.values() if p.client.sock is sock), None)
        if peer is None:
            return
        while (inc := peer.client.recv_nowait()) is not None:
            peer.last_seen = time.monotonic()
            if isinstance(inc.msg, KVHandshakeReply):
                self.on_handshake_reply(peer, inc.msg)
                if peer.address not in self.peers:
                    return
            elif isinstance(inc.msg, KVReady):
                self.on_kv_ready(peer, inc.msg, inc.frames)
            elif isinstance(inc.msg, PrefillFailed):
                req = self.awaiting_kv.get(inc.msg.request_id)
                if req:
                    self.fail(req, f"prefill failed: {inc.msg.message}")

    def on_kv_ready(self, peer: PrefillPeer, ready: KVReady, frames: list[bytes]) -> None:
        req = self.awaiting_kv.get(ready.request_id)
        if req is None or ready.request_id in self.receiving:
            self.log(f"KVReady for unknown request {ready.request_id!r} ignored")
            return
        try:
            pending = self.receiver.receive(ready, frames, req.dst_blocks, peer.info)  # type: ignore[union-attr]
        except TransferError as e:
            self.fail(req, f"KV transfer rejected: {e}", code="transfer_error")
            return
        if pending is None:
            self.kv_landed(req, ready)
        else:  # lands in poll_receives; meanwhile the running batch keeps decoding
            self.receiving[ready.request_id] = (ready, pending)

    def poll_receives(self) -> None:
        for rid, (ready, pending) in list(self.receiving.items()):
            if not pending.done():
                continue
            del self.receiving[rid]
            req = self.awaiting_kv.get(rid)
            if req is None:  # failed meanwhile (its P was dropped): the data is not wanted
                continue
            try:
                pending.land()
            except TransferError as e:
                self.fail(req, f"KV transfer failed: {e}", code="transfer_error")
                continue
            self.kv_landed(req, ready)

    def kv_landed(self, req: Request, ready: KVReady) -> None:
        """The prompt's KV is in the reserved blocks: start decoding it."""
        del self.awaiting_kv[req.request_id]
        now = time.time()
        req.timeline.update(ready.timeline, kv_ready=now)
        if req.aborted:
            self.finish(req, "abort")
            return
        seq = req.seq
        self.counters["blocks_received"] += len(req.dst_blocks)
        seq.num_computed_tokens = len(seq)
        self.engine.block_manager.cache_full_blocks(seq)
        seq.token_ids.append(ready.first_token)
        req.timeline["first_token"] = now
        try:
            self.engine.runner.restore_generator(seq, ready.sampler_state)
        except ValueError as e:  # a P on another kind of device: the seed alone still works
            self.log(f"request {req.request_id}: {e}; sampling goes on from the seed alone")
        reason = self.engine.check_stop(seq)
        if reason:
            self.finish(req, reason, new_tokens=[ready.first_token])
        else:
            self.send_tokens(req, [ready.first_token])
            self.engine.scheduler.add_running(seq)

    # ---- reservations ----------------------------------------------------------------
    def try_reserve(self) -> None:
        bm = self.engine.block_manager
        sched = self.engine.scheduler
        for req in list(self.pending):
            if len(sched.running) + len(self.awaiting_kv) >= self.config.scheduler.max_num_seqs:
                return
            peer = self.peers.get(req.prefill_addr)
            if peer is None:
                self.pending.remove(req)
                self.fail(req, f"prefill worker at {req.prefill_addr} is not connected", code="worker_failed")
                continue
            if not peer.ready:
                continue  # its handshake is still in flight
            seq = req.seq
            cached = bm.find_cached_prefix(seq.token_ids)
            n_new = len(seq) - len(cached) * bm.block_size
            if not bm.can_admit(seq, cached, n_new):
                return  # wait for blocks; FIFO, so nothing behind it jumps the queue
            self.pending.remove(req)
            bm.admit(seq, cached)
            bm.allocate(seq, n_new)
            req.dst_blocks = seq.block_table[len(cached):]
            self.counters["blocks_reused"] += len(cached)
            req.timeline["decode_reserved"] = time.time()
            self.awaiting_kv[req.request_id] = req
            peer.client.send(PrefillRequest(req.request_id, self.worker_id, seq.token_ids,
                                            _sampling(seq), len(cached), req.dst_blocks, req.timeline))

    # ---- the step ------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def step(self) -> None:
        start = time.time()
        outputs = self.engine.step()
        now = time.time()
        for seq in self.engine.scheduler.running:  # colocated prompts: when their prefill began
            req = self.by_seq.get(seq.seq_id)
            if req is not None and not req.prefill_addr:
                req.timeline.setdefault("prefill_start", start)
        for out in outputs:
            req = self.by_seq[out.seq.seq_id]
            if not req.prefill_addr:
                req.timeline.setdefault("prefill_start", start)
                req.timeline.setdefault("prefill_end", now)
            req.timeline.setdefault("first_token", now)
            if out.finished:
                self.finish(req, out.seq.finish_reason or "stop", new_tokens=[out.new_token], scheduled=False)
            else:
                self.send_tokens(req, [out.new_token])

    def idle_wait_ms(self) -> int:
        return 1 if self.receiving else 10  # a landed receive is noticed within 1 ms

    def idle(self) -> None:
        self.poll_receives()
        self.try_reserve()
        now = time.monotonic()
        for peer in list(self.peers.values()):
            if not peer.ready:
                if now > peer.deadline:
                    self.refuse(peer, f"prefill worker at {peer.address} did not answer the handshake "
                                      f"within {self.wconfig.peer_timeout_s:.0f} s")
                continue
            if self.backend in ("shm", "cuda_ipc") and peer.info.get("host") == socket.gethostname():
                # P writes straight into our blocks: only a P whose process is gone is dead
                # (a P busy with a long prefill is silent but may still be writing)
                if not _pid_alive(peer.info.get("pid", 0)):
                    self.drop_peer(peer, "its process exited")
            elif now - peer.last_seen > self.wconfig.peer_timeout_s:
                self.drop_peer(peer, f"no reply for {self.wconfig.peer_timeout_s:.0f} s")
            if peer.address in self.peers and now - peer.last_ping > self.wconfig.peer_timeout_s / 4:
                peer.last_ping = now
                peer.client.send(StatusRequest())

    def load(self) -> tuple[int, int]:
        s = self.engine.scheduler
        return len(s.waiting) + len(self.pending), len(s.running) + len(self.awaiting_kv)

    # ---- replies ---------------------------------------------------------------------
    def send_tokens(self, req: Request, tokens: list[int]) -> None:
        self.server.send(req.identity, TokenOutput(req.request_id, tokens))

    def finish(self, req: Request, reason: str, new_tokens: list[int] = (), scheduled: bool = True) -> None:
        """Final reply, then release the request's blocks (unless the engine already did)."""
        seq = req.seq
        req.timeline["finish"] = time.time()
        self.server.send(req.identity, TokenOutput(
            req.request_id, list(new_tokens), finished=True, finish_reason=reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens,
            timeline=req.timeline if req.return_timeline else None))
        if scheduled and not seq.is_finished:
            self.engine.scheduler.finish(seq, reason)
        self.engine.runner.release(seq.seq_id)
        self._forget(req)
        self.counters["finished"] += 1

    def fail(self, req: Request, message: str, code: str = "bad_request") -> None:
        self.awaiting_kv.pop(req.request_id, None)
        if not req.seq.is_finished:
            self.engine.scheduler.finish(req.seq, "error")
        self.server.send(req.identity, ErrorReply(req.request_id, message, code))
        self._forget(req)
        self.counters["failed"] += 1

    def abort(self, req: Request) -> None:
        if req.request_id in self.awaiting_kv:
            req.aborted = True  # P may be writing into its blocks: free them on KVReady
            return
        if req in self.pending:
            self.pending.remove(req)
        self.finish(req, "abort")

    def _forget(self, req: Request) -> None:
        self.requests.pop(req.request_id, None)
        self.by_seq.pop(req.seq.seq_id, None)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.client.close()
        if self.receiver:
            if hasattr(self, "engine"):
                self.engine.runner = None  # drop views of the shared cache before unmapping it
            self.receiver.close()
            self.receiver = None
        super().close()


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return True  # unknown: assume alive rather than free blocks P may write
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sampling(seq: Sequence):
    from common.sampling_params import to_wire
    return to_wire(seq.sampling_params)


def serve(engine_config: EngineConfig, worker_config: WorkerConfig) -> None:
    DecodeWorker(engine_config, worker_config).run()


__all__ = ["DecodeWorker", "HandshakeError", "serve", "WorkerStatus"]
