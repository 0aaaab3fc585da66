"""What every worker process shares: the server socket, the poll loop, heartbeats to the
router, the ready file the launcher waits for, and a clean stop on SIGTERM/SIGINT."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import threading
from pathlib import Path

import zmq

from pdserve.common.clock import SYSTEM_CLOCK, Clock
from pdserve.common.wire.auth import DeploymentKey
from pdserve.common.config import ConfigError, EngineConfig, WorkerConfig
from pdserve.common.engine.engine import LLMEngine
from pdserve.common.gc_tuning import freeze_startup_heap
from pdserve.common.engine.kv_layout import layout_of
from pdserve.common.worker.host import local_host_id
from pdserve.common.worker.liveness import process_alive
from pdserve.common.worker.router_link import RouterLink, RouterLost
from pdserve.common.wire.messages import WorkerDrain, WorkerHello, WorkerStatus
from pdserve.common.wire.transport import Client, Incoming, Server
from pdserve.kernels.atomic_file import replaced



IDLE_WAIT_MS = 50  # an idle loop's socket wait (WorkerBase.idle_wait_ms)


class WorkerBase:
    """Owns the ZeroMQ context, the server socket and the loop; subclasses own the engine."""

    role = "worker"
    engine: LLMEngine  # set by the subclass's constructor, before `run`

    def __init__(self, engine_config: EngineConfig, worker_config: WorkerConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = engine_config
        self.clock = clock  # heartbeats, drains, leases, peer checks and timeline stamps read it
        self.wconfig = worker_config
        self.worker_id = worker_config.worker_id
        self.host_id = local_host_id(worker_config.host_id)  # peers compare it to decide "same host"
        if not worker_config.secret:
            raise ConfigError("the worker config file has no deployment secret: every internal message is "
                              "authenticated with it (the launcher writes it; `--secret-file` across hosts)")
        try:
            self.key = DeploymentKey(worker_config.secret, worker_config.curve)
        except ValueError as e:
            raise ConfigError(f"worker config field 'secret': {e}") from None
        self.ctx = zmq.Context()
        self.server = Server(self.ctx, worker_config.bind, key=self.key)
        self.poller = zmq.Poller()
        self.poller.register(self.server.sock, zmq.POLLIN)
        # watched: a router that fails our handshake holds another secret (or --curve), so no hello would land.
        # A joined worker (no router pid to watch) pings its router instead: one whose host died is
        # noticed within router_timeout_s (common/worker/router_link.py)
        joined = bool(worker_config.report_to) and worker_config.router_pid <= 0
        self.pings = (worker_config.heartbeat_s, worker_config.router_timeout_s) if joined else None
        self.reporter = Client(self.ctx, worker_config.report_to, key=self.key, watch_handshakes=True,
                               heartbeat=self.pings) if worker_config.report_to else None
        self.router_link = RouterLink(worker_config.router_timeout_s, worker_config.rejoin_timeout_s,
                                      clock.monotonic()) if joined else None
        self.counters: dict[str, int] = {}
        self._stop = False
        self._closed = threading.Event()
        self.draining_until: float | None = None  # SIGTERM: finish what is in flight until then
        # watched as our parent when it is one: a reused pid cannot fool os.getppid()
        self._watched = worker_config.router_pid or worker_config.parent_pid  # exit when it is gone (0: none)
        self._watched_is_parent = self._watched > 0 and os.getppid() == self._watched
        self._last_heartbeat = 0.0
        self._last_status: WorkerStatus | None = None
        self.layout = layout_of(engine_config)

    # ---- hooks for subclasses ---------------------------------------------------------
    def handle(self, inc: Incoming) -> None:
        raise NotImplementedError

    def has_work(self) -> bool:
        raise NotImplementedError

    def step(self) -> None:
        raise NotImplementedError

    def idle_wait_ms(self) -> int:
        """How long the loop blocks on its sockets when it has no step to run. A message
        wakes it at once; the wait only paces timers (heartbeats every heartbeat_s, leases
        and peer checks of seconds), so it can be long and an idle worker takes next to no
        CPU: waking every few ms would cost an idle worker a noticeable share of a core."""
        return IDLE_WAIT_MS

    def idle(self) -> None:
        """Called every loop turn (timeouts, background completions)."""

    def flush(self) -> None:
        """Called at the end of every loop turn: send what the turn produced as one message
        per connection (the decode worker's outputs)."""

    def on_socket(self, sock: zmq.Socket) -> None:
        """A registered socket other than the server socket is readable."""

    def load(self) -> tuple[int, int]:
        """(waiting, running) for status reports."""
        raise NotImplementedError

    def drained(self) -> bool:
        """Nothing in flight: a draining worker may exit."""
        return not self.has_work()

    def release_shared(self) -> None:
        """Last resort before a forced exit (called from the watchdog thread): give back
        what outlives the process (a shared-memory segment's name)."""

    def on_router_lost(self) -> int:
        """The router has been unreachable for router_timeout_s: give up every request it
        sent (it has counted this worker dead and moved them elsewhere, or it died with
        its clients' connections) and free what they hold; returns how many."""
        return 0

    # ---- shared machinery ---------------------------------------------------------------
    def log(self, text: str) -> None:
        print(f"[{self.role} {self.worker_id}] {text}", file=sys.stderr, flush=True)

    def dist_info(self) -> dict:
        return {"rank": self.wconfig.rank} if self.wconfig.kv_transfer in ("gloo", "nccl") else {}

    def status(self, with_events: bool = False) -> WorkerStatus:
        bm = self.engine.block_manager
        waiting, running = self.load()
        stored, evicted = [], []
        if with_events:
            for kind, h in bm.take_events():
                (stored if kind == "stored" else evicted).append(h)
        counters = dict(self.counters, prefix_hit_blocks=bm.num_cached_blocks_hit,
                        prefix_query_blocks=bm.num_blocks_queried)
        if (spec := self.engine.speculator) is not None:  # speculative decoding's totals (router: per step)
            counters.update(spec_drafts=spec.stats.num_drafts, spec_draft_tokens=spec.stats.num_draft_tokens,
                            spec_accepted_tokens=spec.stats.num_accepted_tokens)
        return WorkerStatus(self.worker_id, self.role, waiting, running, bm.num_free_blocks, bm.num_blocks,
                            counters, stored, evicted)

    def write_ready_file(self, **extra) -> None:
        if not self.wconfig.ready_file:
            return
        info = {"worker_id": self.worker_id, "role": self.role, "address": self.server.address,
                "pid": os.getpid(), "num_blocks": self.engine.block_manager.num_blocks,
                "block_size": self.config.cache.block_size, **extra}
        with replaced(self.wconfig.ready_file) as tmp:  # whoever polls it reads it whole
            Path(tmp).write_text(json.dumps(info))

    def request_stop(self, *_: object) -> None:
        """First SIGTERM: drain (refuse new work, finish what runs, up to `drain_s`);
        a second one, or SIGINT: stop now."""
        if self.draining_until is None and self.wconfig.drain_s > 0:
            self.begin_drain("SIGTERM")
        else:
            self._stop = True

    def begin_drain(self, why: str) -> None:
        """Refuse new work, finish what runs (up to `drain_s`), then leave the loop: the
        process exits with code 0."""
        if self.draining_until is None:
            self.draining_until = self.clock.monotonic() + self.wconfig.drain_s
            self.log(f"draining (up to {self.wconfig.drain_s:.0f} s): {why}")

    def router_gone(self) -> bool:
        """Whether the process this worker exits with (its router's, or its owner's:
        router_pid, parent_pid) is gone."""
        pid = self._watched
        if pid <= 0:
            return False
        return os.getppid() != pid if self._watched_is_parent else not process_alive(pid)

    def hello(self) -> WorkerHello:
        return WorkerHello(self.worker_id, self.role, self.server.address, self.config.device.device,
                           self.engine.block_manager.num_blocks, self.config.cache.block_size,
                           self.layout.model_fingerprint)

    def run(self) -> None:
        signal.signal(signal.SIGTERM, self.request_stop)
        signal.signal(signal.SIGINT, lambda *_: setattr(self, "_stop", True))
        self.write_ready_file()
        if self.reporter is not None:
            self.reporter.send_or_drop(self.hello())
        threading.Thread(target=self._keepalive, name="keepalive", daemon=True).start()
        warm = self.engine.warm_up_s
        self.log(f"ready on {self.server.address}" + (f" (warm-up {warm * 1000:.0f} ms)" if warm is not None else ""))
        freeze_startup_heap()  # the model, torch and the rest: out of every later collection
        try:
            while not self._stop:
                busy = self.has_work()
                for sock, _ in self.poller.poll(0 if busy else self.idle_wait_ms()):
                    if sock is self.server.sock:
                        self._drain_server()
                    else:
                        self.on_socket(sock)
                self.idle()
                if self.has_work():
                    self.step()
                self.flush()
                self._heartbeat()
                if self.draining_until is not None and (self.drained() or self.clock.monotonic() > self.draining_until):
                    break
        finally:
            self.close()
            self._closed.set()

    def _drain_server(self) -> None:
        while True:
            try:
                inc = self.server.recv()
            except zmq.Again:
                return
            if inc is not None and isinstance(inc.msg, WorkerDrain):
                self.begin_drain("the router asked (its pool shrinks)")
            elif inc is not None:
                self.handle(inc)

    def _heartbeat(self) -> None:
        if self.reporter is None:
            return
        now = self.clock.monotonic()
        if now - self._last_heartbeat >= self.wconfig.heartbeat_s:
            self._last_heartbeat = now
            why = self.reporter.handshakes.poll()
            if why is not None:
                raise ConfigError(f"cannot join the router at {self.wconfig.report_to}: {why}")
            if self.router_link is not None:
                self._watch_router(now)
            status = self.status(with_events=True)
            self.reporter.send_or_drop(status)
            self._last_status = dataclasses.replace(status, kv_stored=[], kv_evicted=[])

    def _watch_router(self, now: float) -> None:
        """Act on the router's reachability (common/worker/router_link.py); RouterLost
        when no router came back within rejoin_timeout_s."""
        assert self.reporter is not None and self.reporter.handshakes is not None and self.router_link is not None
        cfg, watch = self.wconfig, self.reporter.handshakes
        action = self.router_link.observe(watch.connected, watch.handshakes, now)
        if action == "back":
            self.log(f"router at {cfg.report_to} reachable again: saying hello")
            self.reporter.send_or_drop(self.hello())
        elif action == "lost":
            given_up = self.on_router_lost()
            self.log(f"router at {cfg.report_to} unreachable for {cfg.router_timeout_s:g} s: gave up the "
                     f"{given_up} request(s) it sent; waiting up to {cfg.rejoin_timeout_s:g} s for a router")
        elif action == "give_up":
            why = self.router_link.why(cfg.report_to, now)
            self.log(why)
            raise RouterLost(why)

    def _keepalive(self) -> None:
        """Background thread, off the step loop: repeat the last status (without KV events)
        while the loop is inside a long step, so a multi-second prefill does not look like a
        dead worker; and watch the router: when it is gone, stop the loop (which closes
        everything, the shm segment included) -- or, if the loop is stuck in a step for
        another 5 s, release what outlives us and exit. A joined worker (no router pid)
        says hello again every router_timeout_s instead: a restarted router registers it.
        It has its own socket: ZeroMQ sockets are not shared between threads."""
        cfg = self.wconfig
        sock = Client(self.ctx, cfg.report_to, key=self.key, heartbeat=self.pings) if cfg.report_to else None
        tick = min(cfg.heartbeat_s, cfg.router_timeout_s / 2)
        hello = self.hello() if sock is not None and cfg.router_pid <= 0 else None
        last_hello = self.clock.monotonic()
        try:
            while not self._stop:
                self.clock.sleep(tick)
                if self._stop:
                    break  # close() is terming the context: a send now would raise
                if sock is not None and self._last_status is not None and \
                        self.clock.monotonic() - self._last_heartbeat > 2 * cfg.heartbeat_s:
                    sock.send_or_drop(self._last_status)
                if hello is not None and self.clock.monotonic() - last_hello >= cfg.router_timeout_s:
                    # a joined worker has no router pid to watch: it keeps serving, and says
                    # hello again, so a router that restarted (or missed the first) registers it
                    last_hello = self.clock.monotonic()
                    sock.send_or_drop(hello)
                if self.router_gone():
                    self.log(f"{'router' if cfg.router_pid else 'parent'} (pid {self._watched}) is gone: stopping")
                    self._stop = True
                    if sock is not None:
                        sock.close()  # close() terms the context, which waits for this socket
                        sock = None
                    if not self._closed.wait(5.0):
                        self.log("the loop did not stop within 5 s: forced exit")
                        self.release_shared()
                        os._exit(70)
        except zmq.ZMQError:
            if not self._stop:
                raise
            # else: the loop closed the context between our check and a send (exiting anyway)
        finally:
            if sock is not None:
                sock.close()

    def close(self) -> None:
        self._stop = True  # the keepalive thread closes its socket within heartbeat_s; term() waits
        self.server.close()
        if self.reporter:
            self.reporter.close()
        self.ctx.term()
        try:
            import torch.distributed as dist
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass
