"""Fakes and a harness that drive a real DecodeWorker in-process: a recorder for the
router socket, a fake KV receiver whose receives land at once, stay in flight until the
test says so, or are refused, and a fake ready prefill peer whose messages the test
delivers."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.wire.auth import new_secret
from pdserve.common.config import EngineConfig, WorkerConfig
from pdserve.common.wire.messages import (ErrorReply, GenerateRequest, KVReady, PrefillFailed, PrefillRequest, RequestOutput,
                                  StepOutputs)
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.transport import Incoming
from pdserve.decode_node.peers import PeerLost, PeerMessage, PrefillPeer
from pdserve.decode_node.requests import DecodeRequest, State
from pdserve.decode_node.worker import DecodeWorker
from pdserve.kv_transfer import KVReceiver, PendingReceive, TransferError

BLOCK = 16
NUM_BLOCKS = 32
MAX_LEN = 128
P_ADDR = "tcp://127.0.0.1:1"  # never connected: the peer's client is a fake


# ---- fakes ----------------------------------------------------------------------------------

class Recorder:
    """Stands in for the worker's server socket: every message as sent (`messages`) and
    every reply, a StepOutputs' entries one by one (`sent`), by request id. Reading the
    replies first flushes the worker's outbox, as the end of its loop turn would."""

    address = "tcp://127.0.0.1:0"

    def __init__(self) -> None:
        self.messages: list[tuple[bytes, object]] = []
        self.flush = lambda: None  # the worker's end-of-turn flush, set by make_harness

    def send(self, identity: bytes, msg: object, frames=()) -> None:
        self.messages.append((identity, msg))

    def close(self) -> None:
        pass

    @property
    def sent(self) -> list[tuple[bytes, object]]:
        self.flush()
        return [(i, e) for i, m in self.messages
                for e in (m.outputs if isinstance(m, StepOutputs) else [m])]

    def replies(self, request_id: str) -> list[object]:
        return [m for _, m in self.sent if getattr(m, "request_id", None) == request_id]


class FakeClient:
    """The prefill peer's socket: records what D asks of P."""

    def __init__(self) -> None:
        self.sent: list[object] = []

    def send(self, msg: object, frames=()) -> None:
        self.sent.append(msg)

    def close(self) -> None:
        pass

    def prefill_requests(self) -> list[PrefillRequest]:
        return [m for m in self.sent if isinstance(m, PrefillRequest)]


class FakeTransfer:
    """A receive in flight; the test decides when it is done and whether landing fails."""

    def __init__(self, on_land=None) -> None:
        self.finished = False
        self.fail = False
        self.landed = 0
        self.on_land = on_land

    def pending(self) -> PendingReceive:
        return PendingReceive(done=lambda: self.finished, land=self.land)

    def land(self) -> None:
        assert self.finished, "landed before done"
        self.landed += 1
        if self.fail:
            raise TransferError("the peer hung up mid-transfer")
        if self.on_land:
            self.on_land()


class FakeReceiver(KVReceiver):
    """Over the worker's real cache. `plan[request_id]` says what the next receive does:
    None (landed at once, like shm), a FakeTransfer (in flight) or "reject" (TransferError).
    `fill[request_id]`, if set, is called with the destination blocks when the KV lands."""

    backend = "tcp"

    def __init__(self, kv_cache: torch.Tensor) -> None:
        super().__init__(kv_cache)
        self.plan: dict[str, object] = {}
        self.fill: dict[str, object] = {}
        self.calls: list[tuple[str, list[int]]] = []
        self.closed = False

    def backend_info(self) -> dict:
        return {}

    def receive(self, ready, frames, dst_blocks, peer):
        super().receive(ready, frames, dst_blocks, peer)  # the size check of every backend
        self.calls.append((ready.request_id, list(dst_blocks)))
        what = self.plan.pop(ready.request_id, None)
        if what == "reject":
            raise TransferError(f"request {ready.request_id}: payload does not fit")
        fill = self.fill.get(ready.request_id)
        if what is None:
            if fill:
                fill(list(dst_blocks))
            return None
        assert isinstance(what, FakeTransfer)
        if fill and what.on_land is None:
            what.on_land = lambda: fill(list(dst_blocks))
        return what.pending()

    def close(self) -> None:
        self.closed = True


# ---- the harness ----------------------------------------------------------------------------

@dataclass
class Harness:
    worker: DecodeWorker
    server: Recorder
    receiver: FakeReceiver
    peer: PrefillPeer
    client: FakeClient
    baseline: int
    identities: dict[str, bytes] = field(default_factory=dict)

    # -- the router side
    def generate(self, rid: str, prompt: list[int], max_tokens: int = 4, local: bool = False, **sp) -> None:
        identity = f"router-{rid}".encode()
        self.identities[rid] = identity
        timeline = sp.pop("return_timeline", False)
        params = SamplingParams(temperature=sp.pop("temperature", 0.0), max_tokens=max_tokens,
                                ignore_eos=sp.pop("ignore_eos", True), **sp)
        self.worker.on_generate(identity, GenerateRequest(rid, prompt, params, "" if local else P_ADDR,
                                                          return_timeline=timeline))

    def state(self, rid: str) -> State | None:
        req = self.worker.requests.get(rid)
        return None if req is None else req.state

    def req(self, rid: str) -> DecodeRequest:
        req = self.worker.requests.get(rid)
        assert req is not None, f"{rid} is not in the table"
        return req

    def abort(self, rid: str) -> None:
        self.worker.abort(self.req(rid))

    # -- the prefill side
    def prefill_request(self, rid: str) -> PrefillRequest:
        reqs = [m for m in self.client.prefill_requests() if m.request_id == rid]
        assert len(reqs) == 1, f"{rid}: {len(reqs)} PrefillRequests sent"
        return reqs[0]

    def kv_ready(self, rid: str, first_token: int = 7, num_blocks: int | None = None, sampler_state: bytes = b"") -> None:
        if num_blocks is None:
            num_blocks = len(self.prefill_request(rid).dst_block_ids)
        msg = KVReady(rid, first_token, num_blocks, sampler_state=sampler_state)
        self.worker.on_peer_events([PeerMessage(self.peer, Incoming(None, msg, []))])

    def prefill_failed(self, rid: str, why: str = "out of memory") -> None:
        self.worker.on_peer_events([PeerMessage(self.peer, Incoming(None, PrefillFailed(rid, why), []))])

    def peer_lost(self, why: str = "its process exited") -> None:
        self.worker.peers.peers.pop(P_ADDR, None)
        self.worker.on_peer_events([PeerLost(P_ADDR, why, True)])

    def receiving(self, rid: str) -> tuple[int, "FakeTransfer"]:
        """Reserve `rid` and deliver its KVReady with the receive left in flight: (blocks
        it holds, the transfer the test finishes)."""
        self.worker.try_reserve()
        held = self.held(rid)
        t = FakeTransfer()
        self.receiver.plan[rid] = t
        self.kv_ready(rid)
        assert self.state(rid) == State.RECEIVING
        return held, t

    # -- the loop
    def turn(self) -> None:
        """One loop turn of WorkerBase.run without sockets: idle work, then a step if any."""
        self.worker.idle()
        if self.worker.has_work():
            self.worker.step()
        self.worker.flush()

    def run_until_idle(self, max_turns: int = 200) -> None:
        for _ in range(max_turns):
            if not self.worker.has_work() and not self.worker.requests.count(State.RECEIVING):
                return
            self.turn()
        raise AssertionError("no progress")

    # -- checks
    @property
    def free(self) -> int:
        return self.worker.engine.block_manager.num_free_blocks

    def held(self, rid: str) -> int:
        return len(self.req(rid).seq.block_table)

    def tokens(self, rid: str) -> list[int]:
        return [t for m in self.server.replies(rid) if isinstance(m, RequestOutput) for t in m.token_ids]

    def terminal(self, rid: str) -> object:
        """The one terminal reply `rid` got, checked to be its last reply."""
        replies = self.server.replies(rid)
        ends = [i for i, m in enumerate(replies)
                if isinstance(m, ErrorReply) or (isinstance(m, RequestOutput) and m.finished)]
        assert len(ends) == 1, f"{rid}: {len(ends)} terminal replies in {replies}"
        assert ends[0] == len(replies) - 1, f"{rid}: replies after the terminal one: {replies}"
        sent = self.server.sent
        for m in replies:
            assert m is replies[-1] or isinstance(m, RequestOutput), m
            assert next(i for i, x in sent if x is m) == self.identities[rid]
        return replies[-1]

    def check_clean(self) -> None:
        bm = self.worker.engine.block_manager
        bm.check_invariants()
        assert len(self.worker.requests) == 0, [r.state for r in self.worker.requests.in_state(*State)]
        assert bm.num_free_blocks == bm.num_blocks == self.baseline
        s = self.worker.engine.scheduler
        assert not s.waiting and not s.running and not s.reserved
        for rid in self.identities:
            self.terminal(rid)


def make_harness(config: EngineConfig, worker_id: str = "d0", clock: Clock = SYSTEM_CLOCK, lease_s: float = 30.0) -> Harness:
    worker = DecodeWorker(config, WorkerConfig(role="decode", worker_id=worker_id, kv_transfer="tcp", secret=new_secret(),
                                               lease_s=lease_s), clock)
    worker.server.close()  # the real socket is never used: replies are recorded
    server = Recorder()
    server.flush = worker.flush
    worker.server = server
    real = worker.receiver
    receiver = FakeReceiver(real.kv_cache)
    worker.receiver = receiver
    real.close()
    client = FakeClient()
    now = clock.monotonic()
    peer = PrefillPeer(P_ADDR, client, now, now + 30.0, prefill_id="p0", info={}, ready=True)
    worker.peers.peers[P_ADDR] = peer
    return Harness(worker, server, receiver, peer, client, worker.engine.block_manager.num_free_blocks)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 2000) for _ in range(n)]


def nblocks(n_tokens: int) -> int:
    return -(-n_tokens // BLOCK)


