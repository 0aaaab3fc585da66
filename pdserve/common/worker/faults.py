"""Fault injection as configuration, off by default: the reliability tests (and anyone
reproducing a failure) set `PDSERVE_FAULTS` in a worker's environment.

    PDSERVE_FAULTS="kill_after_prefill=1@prefill-0,delay_transfer_ms=3000"

Entries are `name=value`, comma-separated; `name=value@worker_id` applies to that worker
only. Counting faults fire once, at the Nth occurrence (1-based) in that worker.

No production function checks a fault. A worker's constructor calls `wrap_prefill` or
`wrap_decode` once; each armed fault wraps the part it breaks, and with nothing armed
nothing is wrapped (the worker runs its own objects):

| name | worker | wrapper (what it wraps) | what happens at the Nth occurrence |
| --- | --- | --- | --- |
| kill_after_prefill=N | prefill | `HandOffFaults` (server socket) | the Nth KVReady: SIGKILL itself instead of sending it |
| drop_transfer=N | prefill | `HandOffFaults` | the Nth KVReady is never sent (a lost transfer) |
| corrupt_transfer=N | prefill | `HandOffFaults` | the Nth KVReady's checksum does not match its data (as if bytes flipped) |
| delay_transfer_ms=MS | prefill | `HandOffFaults` | KVReady number `delay_transfer_at` (default 1) waits MS ms (a slow writer) |
| kill_mid_transfer=N | prefill | `KillMidTransfer` (runner's `execute`) | the Nth step that writes KV layer by layer: SIGKILL itself after half the layers |
| kill_mid_decode=N | decode | `KillAtToken` (server socket) | the outgoing message holding its Nth token: SIGKILL itself instead of sending it |
| delay_step_ms=MS | any | `DelayedStep` (worker's `step`) | every step waits MS ms first (a slow worker: a long output outlasts a test's timeouts, prompts stay in flight on a prefill worker) |

One more, for the step-isolation tests: `PDSERVE_TEST_FAULT_TOKEN=<token id>` (any worker)
wraps the runner's `execute` in `PoisonToken`: a step that samples for a sequence holding
that token raises after its forward (KV written), as a real per-request failure would.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Callable

from pdserve.common.config import ConfigError
from pdserve.common.engine.scheduler import ScheduledBatch
from pdserve.common.wire.messages import KVReady, StepOutputs
from pdserve.common.wire.transport import Server

if TYPE_CHECKING:
    from pdserve.common.engine.model_runner import Sampled
    from pdserve.common.worker.base import WorkerBase

ENV_VAR = "PDSERVE_FAULTS"
FAULT_TOKEN_ENV = "PDSERVE_TEST_FAULT_TOKEN"

Execute = Callable[..., "dict[int, Sampled]"]  # ModelRunner.execute(batch, layer_hook=None) -> {seq_id: token}


@dataclass
class Faults:
    """The faults armed in one worker, and how often each point has been passed."""

    kill_after_prefill: int = 0
    kill_mid_transfer: int = 0
    kill_mid_decode: int = 0
    drop_transfer: int = 0
    corrupt_transfer: int = 0
    delay_transfer_ms: int = 0
    delay_transfer_at: int = 1
    delay_step_ms: int = 0
    fault_token: int | None = None  # from FAULT_TOKEN_ENV, not from ENV_VAR
    seen: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, worker_id: str) -> "Faults":
        names = {f.name for f in fields(cls)} - {"seen", "fault_token"}
        values: dict[str, int] = {}
        for entry in filter(None, (e.strip() for e in text.split(","))):
            key, sep, value = entry.partition("=")
            value, _, target = value.partition("@")
            if not sep or key not in names:
                raise ConfigError(f"{ENV_VAR}: {entry!r} is not name=value with a name from {sorted(names)}")
            try:
                n = int(value)
            except ValueError:
                raise ConfigError(f"{ENV_VAR}: {entry!r}: the value must be an integer") from None
            if not target or target == worker_id:
                values[key] = n
        return cls(**values)

    @classmethod
    def from_env(cls, worker_id: str) -> "Faults":
        faults = cls.parse(os.environ.get(ENV_VAR, ""), worker_id)
        token = os.environ.get(FAULT_TOKEN_ENV, "")
        faults.fault_token = int(token) if token.isdigit() else None
        return faults

    def hit(self, name: str) -> bool:
        """Count one pass of the point `name`; True if its fault fires now."""
        n = self.seen[name] = self.seen.get(name, 0) + 1
        return getattr(self, name) == n

    def pass_tokens(self, name: str, count: int) -> bool:
        """Count `count` passes at once (tokens); True if the Nth falls among them."""
        before = self.seen.get(name, 0)
        self.seen[name] = before + count
        target = getattr(self, name)
        return 0 < target and before < target <= before + count

    def kill(self, where: str) -> None:
        print(f"[faults] {where}: killing this process (SIGKILL, injected)", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    # ---- where the wrappers go: one call per worker -----------------------------------------
    def wrap_prefill(self, worker: WorkerBase) -> None:
        """Wrap the parts of a prefill worker that its armed faults break; nothing if none is."""
        if self.kill_after_prefill or self.drop_transfer or self.corrupt_transfer or self.delay_transfer_ms:
            worker.server = HandOffFaults(worker.server, self, worker.log)
        runner = worker.engine.runner
        if self.kill_mid_transfer:
            runner.execute = KillMidTransfer(runner.execute, self, worker.config.model.num_layers)
        if self.delay_step_ms:
            worker.step = DelayedStep(worker.step, self.delay_step_ms)
        self._wrap_fault_token(worker)

    def wrap_decode(self, worker: WorkerBase) -> None:
        """Wrap the parts of a decode (or colocated) worker that its armed faults break;
        nothing if none is."""
        if self.kill_mid_decode:
            worker.server = KillAtToken(worker.server, self)
        if self.delay_step_ms:
            worker.step = DelayedStep(worker.step, self.delay_step_ms)
        self._wrap_fault_token(worker)

    def _wrap_fault_token(self, worker: WorkerBase) -> None:
        if self.fault_token is not None:
            runner = worker.engine.runner
            runner.execute = PoisonToken(runner.execute, self.fault_token)


# ---- the wrappers ----------------------------------------------------------------------------

class ServerWrapper(Server):
    """A worker's server socket with its outgoing messages intercepted: owns nothing but
    the wrapped `Server`, to which everything else (recv, close, `sock` for the poller,
    `address`) goes unchanged."""

    def __init__(self, inner: Server) -> None:  # not Server.__init__: the socket is the inner one's
        self.inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def recv(self) -> Any:
        return self.inner.recv()

    def send(self, identity: bytes, msg: Any, frames: list = ()) -> None:
        self.inner.send(identity, msg, frames)

    def close(self) -> None:
        self.inner.close()


class HandOffFaults(ServerWrapper):
    """The prefill worker's hand-off send (KVReady, after its KV went out), broken as
    configured: killed before, corrupted, dropped or delayed. Owns the log callback."""

    def __init__(self, inner: Server, faults: Faults, log: Callable[[str], None]) -> None:
        super().__init__(inner)
        self.faults = faults
        self.log = log

    def send(self, identity: bytes, msg: Any, frames: list = ()) -> None:
        if not isinstance(msg, KVReady):
            self.inner.send(identity, msg, frames)
            return
        f = self.faults
        if f.hit("kill_after_prefill"):
            f.kill(f"request {msg.request_id} prefilled, before KVReady")
        if f.hit("corrupt_transfer") and msg.checksum >= 0:  # no checksum (verify_transfers off): nothing to break
            self.log(f"request {msg.request_id}: corrupting its transfer (injected)")
            msg.checksum = (msg.checksum + 1) % (1 << 32)
        drop = f.hit("drop_transfer")
        if f.delay_transfer_ms and f.hit("delay_transfer_at"):
            self.log(f"request {msg.request_id}: delaying KVReady by {f.delay_transfer_ms} ms (injected)")
            time.sleep(f.delay_transfer_ms / 1000)
        if drop:
            self.log(f"request {msg.request_id}: dropping KVReady (injected)")
            return
        self.inner.send(identity, msg, frames)


def output_tokens(msg: Any) -> int:
    """How many generated tokens an outgoing message carries (0 for anything but output)."""
    return sum(len(e.token_ids) for e in msg.outputs) if isinstance(msg, StepOutputs) else 0


class KillAtToken(ServerWrapper):
    """The decode worker's output to the router, counted in tokens: the message holding
    the Nth token is never sent -- the process SIGKILLs itself instead."""

    def __init__(self, inner: Server, faults: Faults) -> None:
        super().__init__(inner)
        self.faults = faults

    def send(self, identity: bytes, msg: Any, frames: list = ()) -> None:
        n = output_tokens(msg)
        if n and self.faults.pass_tokens("kill_mid_decode", n):
            self.faults.kill(f"mid-decode, at token {self.faults.kill_mid_decode}")
        self.inner.send(identity, msg, frames)


class DelayedStep:
    """A worker's `step` that first waits `delay_ms` (an injected slow worker)."""

    def __init__(self, step: Callable[[], None], delay_ms: int) -> None:
        self.step = step
        self.delay_ms = delay_ms

    def __call__(self) -> None:
        time.sleep(self.delay_ms / 1000)
        self.step()


class KillMidTransfer:
    """The runner's `execute` whose layer hook (the prefill worker's layer-by-layer KV
    writer) is cut short: in the Nth step that writes KV layer by layer, the process
    SIGKILLs itself once half the layers are written."""

    def __init__(self, execute: Execute, faults: Faults, num_layers: int) -> None:
        self.execute = execute
        self.faults = faults
        self.kill_at_layer = num_layers // 2

    def __call__(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None) -> dict[int, Sampled]:
        if layer_hook is None or not self.faults.hit("kill_mid_transfer"):
            return self.execute(batch, layer_hook)
        write_layer = layer_hook

        def write_then_die(layer: int) -> None:
            write_layer(layer)
            if layer == self.kill_at_layer:
                self.faults.kill(f"after writing layer {layer} of a step's KV")
        return self.execute(batch, write_then_die)


class PoisonToken:
    """The runner's `execute` raising, after the forward and sampling (KV written), for a
    step that sampled a sequence holding `token`: a per-request failure the engine must
    isolate (its failed attempt's generators are put back by the engine)."""

    def __init__(self, execute: Execute, token: int) -> None:
        self.execute = execute
        self.token = token

    def __call__(self, batch: ScheduledBatch, layer_hook: Callable[[int], None] | None = None) -> dict[int, Sampled]:
        sampled = self.execute(batch, layer_hook)
        if any(self.token in s.token_ids for s in batch.seqs if s.seq_id in sampled):
            raise RuntimeError(f"injected fault: a sequence holds token {self.token} ({FAULT_TOKEN_ENV})")
        return sampled
