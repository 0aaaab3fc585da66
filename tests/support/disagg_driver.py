"""Driving real worker processes from a test: start a prefill/decode pair (or one
colocated worker), put many requests in flight at once, collect what comes back.

Every worker runs on one torch thread (a 2-core machine runs P, D and the test process)
and binds to a free port. Options are flat dicts of EngineOptions and WorkerConfig fields
(`WorkerSpec.of`); the launcher hands each worker its config as a file. `Deployment.close()` stops every process it started; use it
from a fixture's teardown so a failing test leaves no workers behind.
"""
from __future__ import annotations

import itertools
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from pdserve.common.wire.auth import DeploymentKey
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import ErrorReply, GenerateRequest, RequestOutput, StatusRequest, StepOutputs, WorkerStatus
from pdserve.common.wire.transport import Client
from pdserve.common.worker.spec import WorkerSpec
from pdserve.router.launch.local import LaunchError, Launcher, WorkerProcess, free_port

BLOCK_SIZE = 16


def engine_options(num_kv_blocks: int = 256, max_model_len: int = 512, block_size: int = BLOCK_SIZE,
                   max_num_seqs: int = 64, max_num_batched_tokens: int = 2048) -> dict:
    """Worker engine options, always on one torch thread, at float32 (where exactness is judged)."""
    return dict(num_kv_blocks=num_kv_blocks, max_model_len=max_model_len, num_threads=1, block_size=block_size,
                dtype="float32", max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens)


def start_worker(launcher: Launcher, name: str, role: str, model_dir: str, options: dict) -> WorkerProcess:
    """Start one worker named `name` with flat `options` (engine and worker fields)."""
    return launcher.start(WorkerSpec.of(model_dir, role, name, **options))


def num_blocks(prompt: list[int], block_size: int = BLOCK_SIZE) -> int:
    """KV blocks a prompt occupies (the last one possibly partial)."""
    return -(-len(prompt) // block_size)


@dataclass
class RunResult:
    """What came back for one batch of requests, keyed by request id."""

    request_ids: list[str]
    tokens: dict[str, list[int]] = field(default_factory=dict)  # streamed output ids, in order
    finals: dict[str, RequestOutput] = field(default_factory=dict)  # the finished=True entry
    errors: dict[str, ErrorReply] = field(default_factory=dict)
    anonymous_errors: list[ErrorReply] = field(default_factory=list)  # request_id "" (undecodable input)
    decode_status: WorkerStatus | None = None
    prefill_status: WorkerStatus | None = None

    def outputs(self, request_ids: list[str] | None = None) -> list[list[int]]:
        """Token lists in request order (default: all); each of them must have finished."""
        ids = self.request_ids if request_ids is None else request_ids
        missing = [r for r in ids if r not in self.finals]
        assert not missing, f"requests without a final output: {missing}; errors: {self.errors}"
        return [self.tokens.get(r, []) for r in ids]


class Deployment:
    """Started workers (a decode or colocated worker, maybe a prefill worker) and the
    client sockets a test talks to them through. Owns the Launcher."""

    def __init__(self, launcher: Launcher, model_dir: str, decode: WorkerProcess,
                 prefill: WorkerProcess | None = None) -> None:
        self.launcher = launcher
        self.model_dir = model_dir
        self.decode = decode
        self.prefill = prefill
        self.ctx = zmq.Context()
        self.key = DeploymentKey(launcher.secret)  # the secret the launcher wrote into every worker's config
        self.client = Client(self.ctx, decode.address, key=self.key)  # requests and their replies
        self._status_clients: dict[str, Client] = {}
        self._ids = itertools.count()

    @property
    def prefill_addr(self) -> str:
        return self.prefill.address if self.prefill else ""

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} log ---\n{w.log_tail(40)}" for w in (self.prefill, self.decode) if w)

    def new_id(self, tag: str = "r") -> str:
        return f"{tag}{next(self._ids)}"

    # ---- status --------------------------------------------------------------------
    def status(self, worker: WorkerProcess | None = None, timeout_s: float = 20.0) -> WorkerStatus:
        """The WorkerStatus of `worker` (default: the decode worker), through its own socket."""
        worker = worker or self.decode
        client = self._status_clients.get(worker.address)
        if client is None:
            client = self._status_clients[worker.address] = Client(self.ctx, worker.address, key=self.key)
        client.send(StatusRequest())
        deadline = time.monotonic() + timeout_s
        while True:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise AssertionError(f"no WorkerStatus from {worker.name} in {timeout_s} s\n{self.logs()}")
            try:
                msg = client.recv(timeout_ms=left).msg
            except TimeoutError:
                raise AssertionError(f"no WorkerStatus from {worker.name} in {timeout_s} s "
                                     f"(alive: {worker.proc.poll() is None})\n{self.logs()}") from None
            if isinstance(msg, WorkerStatus):
                return msg

    def statuses(self) -> tuple[WorkerStatus, WorkerStatus | None]:
        return self.status(self.decode), self.status(self.prefill) if self.prefill else None

    # ---- requests ------------------------------------------------------------------
    def request(self, prompt: list[int], max_tokens: int = 16, request_id: str | None = None,
                **sampling: object) -> GenerateRequest:
        """A greedy (unless overridden) GenerateRequest routed through this deployment's P."""
        fields = {"temperature": 0.0, "max_tokens": max_tokens, **sampling}
        return GenerateRequest(request_id or self.new_id(), prompt, SamplingParams.unchecked(**fields),  # type: ignore[arg-type]
                               prefill_addr=self.prefill_addr)

    def send(self, requests: list[GenerateRequest], raw: list[list[bytes]] = ()) -> None:
        """Put every request (and every raw multipart message, signed as this deployment's
        own -- a malformed message from inside) in flight before reading."""
        for frames in raw:
            self.client.sock.send_multipart([self.client.auth.signer.sign(frames[0], frames[1:]), *frames[1:]])
        for req in requests:
            self.client.send(req)

    def collect(self, request_ids: list[str], num_anonymous: int = 0, timeout_s: float = 60.0) -> RunResult:
        """Read replies until each request finished or failed and `num_anonymous` errors
        with no request id arrived; then query each worker's status."""
        result = RunResult(list(request_ids))
        open_ids = set(request_ids)
        deadline = time.monotonic() + timeout_s
        while open_ids or len(result.anonymous_errors) < num_anonymous:
            left = int((deadline - time.monotonic()) * 1000)
            if left <= 0:
                raise AssertionError(f"timed out after {timeout_s} s waiting for {sorted(open_ids)} and "
                                     f"{num_anonymous - len(result.anonymous_errors)} anonymous error(s)\n{self.logs()}")
            try:
                msg = self.client.recv(timeout_ms=left).msg
            except TimeoutError:
                continue
            if isinstance(msg, ErrorReply):
                if msg.request_id in open_ids:
                    result.errors[msg.request_id] = msg
                    open_ids.discard(msg.request_id)
                else:
                    result.anonymous_errors.append(msg)
            elif isinstance(msg, StepOutputs):  # one per worker loop turn: every request's entry
                for out in msg.outputs:
                    assert out.request_id in open_ids, f"output for a closed or unknown request: {out}"
                    result.tokens.setdefault(out.request_id, []).extend(out.token_ids)
                    if out.finished:
                        result.finals[out.request_id] = out
                        open_ids.discard(out.request_id)
            else:
                raise AssertionError(f"unexpected reply {msg!r}")
        result.decode_status, result.prefill_status = self.statuses()
        return result

    def run(self, prompts: list[list[int]], max_tokens: int = 16, timeout_s: float = 60.0) -> RunResult:
        """Greedy requests for all prompts at once; their outputs and both workers' status."""
        requests = [self.request(p, max_tokens) for p in prompts]
        self.send(requests)
        return self.collect([r.request_id for r in requests], timeout_s=timeout_s)

    def close(self, stop_timeout_s: float = 10.0) -> None:
        """Close the sockets, then stop every worker (SIGKILL after `stop_timeout_s`)."""
        try:
            for client in (self.client, *self._status_clients.values()):
                client.close()
            self.ctx.term()
        finally:
            self.launcher.stop(stop_timeout_s)


def start_pair(model_dir: str, backend: str, options: dict, prefill_options: dict | None = None,
               decode_options: dict | None = None, workdir: str | Path | None = None, together: bool = False,
               timeout_s: float = 120.0) -> Deployment:
    """Start a prefill and a decode worker; `prefill_options` and `decode_options` override
    `options` key by key.

    shm/tcp: P first, then D with `prefill_peers` (D handshakes during its start-up).
    With `together`, P binds a free port chosen here and both start at once (half the
    wall time on two cores); D's start-up handshake then waits for P to come up.
    gloo: always together (both must be inside init_process_group at once, and P writes
    its ready file only after that), and D handshakes on the first request naming P."""
    launcher = Launcher(workdir)
    tag = uuid.uuid4().hex[:6]  # unique worker ids: shm segment names derive from them
    try:
        common = {**options, "kv_transfer": backend}
        p_extra: dict = {}
        d_extra: dict = {}
        dist = backend in ("gloo", "nccl")
        if dist:
            init = f"tcp://127.0.0.1:{free_port()}"
            p_extra = {"dist_init": init, "rank": 0, "world_size": 2}
            d_extra = {"dist_init": init, "rank": 1, "world_size": 2}
        elif together:
            p_addr = f"tcp://127.0.0.1:{free_port()}"
            p_extra = {"bind": p_addr}
            d_extra = {"prefill_peers": (p_addr,)}
        p = start_worker(launcher, f"p-{tag}", "prefill", model_dir, {**common, **p_extra, **(prefill_options or {})})
        if dist or together:
            d = start_worker(launcher, f"d-{tag}", "decode", model_dir, {**common, **d_extra, **(decode_options or {})})
            launcher.wait_ready([p, d], timeout=timeout_s)
        else:
            launcher.wait_ready([p], timeout=timeout_s)
            d = start_worker(launcher, f"d-{tag}", "decode", model_dir,
                             {**common, **(decode_options or {}), "prefill_peers": (p.address,)})
            launcher.wait_ready([d], timeout=timeout_s)
        return Deployment(launcher, model_dir, d, p)
    except BaseException:
        launcher.stop()
        raise


def start_single(model_dir: str, role: str, options: dict, workdir: str | Path | None = None,
                 timeout_s: float = 120.0) -> Deployment:
    """One worker on its own: a colocated worker, or a decode worker with no prefill peer
    (requests with an empty prefill_addr are then prefilled locally)."""
    launcher = Launcher(workdir)
    try:
        w = start_worker(launcher, f"{role[0]}-{uuid.uuid4().hex[:6]}", role, model_dir, options)
        launcher.wait_ready([w], timeout=timeout_s)
        return Deployment(launcher, model_dir, w)
    except BaseException:
        launcher.stop()
        raise


def start_colocated(model_dir: str, options: dict, workdir: str | Path | None = None) -> Deployment:
    return start_single(model_dir, "colocated", options, workdir)


def shm_segments(worker: WorkerProcess) -> list[str]:
    """Shared-memory segments still named after `worker` (a decode worker's shm KV cache)."""
    return sorted(str(p) for p in Path("/dev/shm").glob(f"pdserve-{worker.name}-*"))


__all__ = ["Deployment", "LaunchError", "RunResult", "engine_options", "num_blocks", "shm_segments",
           "start_colocated", "start_pair", "start_single", "start_worker"]
