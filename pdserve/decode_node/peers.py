"""A decode worker's connections to its prefill workers: handshake, liveness, and the
messages they send. It never touches requests: it reports events, and the worker
decides what they mean for the requests that wait on a peer."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import zmq

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.wire.auth import DeploymentKey
from pdserve.common.config import ConfigError
from pdserve.common.worker.host import local_host_id, same_host
from pdserve.common.worker.liveness import process_alive
from pdserve.common.wire.messages import KVHandshake, KVHandshakeReply, KVLayout, StatusRequest
from pdserve.common.wire.transport import Client, Incoming, is_endpoint


class HandshakeError(ConfigError):
    """A prefill worker refused this decode worker (incompatible KV layout or backend)."""


@dataclass
class PrefillPeer:
    """A connection to one prefill worker; `ready` once it accepted our handshake."""

    address: str
    client: Client
    last_seen: float
    deadline: float  # the handshake must be answered by then (monotonic seconds)
    prefill_id: str = ""
    info: dict = field(default_factory=dict)
    last_ping: float = 0.0
    ready: bool = False


@dataclass
class PeerLost:
    """A peer is gone and can write nothing more into our blocks: its handshake was
    refused or timed out, its process exited (shm, CUDA IPC: it writes into our memory),
    or it was silent past the timeout (backends where its data comes through us)."""

    address: str
    why: str
    was_ready: bool


@dataclass
class PeerMessage:
    """A message from a ready peer (KVReady, PrefillFailed, ...)."""

    peer: PrefillPeer
    incoming: Incoming


PeerEvent = PeerLost | PeerMessage
CHECK_EVERY_S = 0.05  # peer liveness is judged in seconds; a step loop turns every few ms


class PrefillPeers:
    """Owns the sockets to prefill workers, keyed by address."""

    def __init__(self, ctx: zmq.Context, poller: zmq.Poller, decode_id: str, timeout_s: float,
                 backend: str, key: DeploymentKey, clock: Clock = SYSTEM_CLOCK, host_id: str = "") -> None:
        self.ctx = ctx
        self.clock = clock
        self.key = key
        self.poller = poller
        self.decode_id = decode_id
        self.timeout_s = timeout_s
        self.backend = backend
        self.host_id = host_id or local_host_id()
        self.peers: dict[str, PrefillPeer] = {}
        self._checked = 0.0  # when check() last looked (monotonic s)

    def get(self, address: str) -> PrefillPeer | None:
        return self.peers.get(address)

    def connect(self, address: str, hello: KVHandshake) -> PrefillPeer:
        """Send the handshake (once per address); the reply is handled by `on_socket`,
        so a slow or absent peer never stalls the running batch."""
        if address in self.peers:
            return self.peers[address]
        if not is_endpoint(address):  # the same rule the router applies to a worker's address
            raise HandshakeError(f"prefill address {address!r} is not a ZeroMQ endpoint (tcp://host:port or ipc://path)")
        try:
            client = Client(self.ctx, address, identity=self.decode_id.encode(), key=self.key)
        except zmq.ZMQError as e:
            raise HandshakeError(f"cannot connect to prefill worker at {address}: {e}") from None
        client.send(hello)
        now = self.clock.monotonic()
        peer = self.peers[address] = PrefillPeer(address, client, now, deadline=now + self.timeout_s)
        self.poller.register(client.sock, zmq.POLLIN)
        return peer

    def wait_ready(self, address: str) -> None:
        """Block until the handshake with `address` is answered (start-up); HandshakeError
        if it is refused or times out."""
        peer = self.peers[address]
        while not peer.ready:
            peer.client.sock.poll(50)
            for event in self.on_socket(peer.client.sock) + self.check():
                if isinstance(event, PeerLost) and event.address == address:
                    raise HandshakeError(event.why)

    def on_socket(self, sock: zmq.Socket) -> list[PeerEvent]:
        """Read what a peer's socket holds: handshake replies are handled here, the rest
        is reported."""
        peer = next((p for p in self.peers.values() if p.client.sock is sock), None)
        events: list[PeerEvent] = []
        while peer is not None and (inc := peer.client.recv_nowait()) is not None:
            peer.last_seen = self.clock.monotonic()
            if isinstance(inc.msg, KVHandshakeReply):
                if not inc.msg.ok:
                    events.append(self._drop(peer, f"prefill worker at {peer.address} refused this decode "
                                                   f"worker: {inc.msg.error}"))
                    break
                peer.ready, peer.prefill_id, peer.info = True, inc.msg.prefill_id, inc.msg.backend_info
            elif peer.ready:
                events.append(PeerMessage(peer, inc))
        return events

    def check(self) -> list[PeerLost]:
        """Handshake deadlines and liveness; pings ready peers. Called between steps, and
        does its work at most every CHECK_EVERY_S (it reads /proc for same-host peers)."""
        now = self.clock.monotonic()
        if now - self._checked < CHECK_EVERY_S:
            return []
        self._checked = now
        lost = []
        for peer in list(self.peers.values()):
            if not peer.ready:
                if now > peer.deadline:
                    lost.append(self._drop(peer, f"prefill worker at {peer.address} did not answer the "
                                                 f"handshake within {self.timeout_s:.0f} s"))
                continue
            if self._writes_into_our_memory(peer) or same_host(self.host_id, peer.info.get("host")):
                # on this host a P's death is confirmed, never guessed from silence: a P busy
                # with a long prefill is silent (and, over shm / CUDA IPC, may still be writing
                # into our blocks). A reaped or zombie process is dead (common/worker/liveness.py).
                if not process_alive(peer.info.get("pid", 0)):
                    lost.append(self._drop(peer, "its process exited"))
                    continue
            elif now - peer.last_seen > self.timeout_s:
                lost.append(self._drop(peer, f"no reply for {self.timeout_s:.0f} s"))
                continue
            if now - peer.last_ping > self.timeout_s / 4:
                peer.last_ping = now
                peer.client.send(StatusRequest())
        return lost

    def _writes_into_our_memory(self, peer: PrefillPeer) -> bool:
        return self.backend in ("shm", "cuda_ipc") and same_host(self.host_id, peer.info.get("host"))

    def _drop(self, peer: PrefillPeer, why: str) -> PeerLost:
        if peer.ready:
            print(f"[decode {self.decode_id}] dropping prefill worker {peer.prefill_id} at {peer.address}: {why}",
                  file=sys.stderr, flush=True)
        else:
            print(f"[decode {self.decode_id}] {why}", file=sys.stderr, flush=True)
        self.poller.unregister(peer.client.sock)
        peer.client.close()
        del self.peers[peer.address]
        return PeerLost(peer.address, why, peer.ready)

    def close(self) -> None:
        for peer in self.peers.values():
            peer.client.close()
        self.peers = {}


__all__ = ["HandshakeError", "KVLayout", "PeerEvent", "PeerLost", "PeerMessage", "PrefillPeer", "PrefillPeers"]
