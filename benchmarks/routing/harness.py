"""The machinery under benchmarks/routing/run.py's measurements: one `pdserve serve` process
per measurement (Server: start, wait for its ready file, read prefill workers' counters and
the router's /metrics, stop it and its workers), a client that talks to a worker directly
with the GenerateRequest the router would send (WorkerClient), the closed-loop driver
(drive) and the per-segment timeline breakdown (SEGMENTS, breakdown). Imported by the
script once it has put the repository root on sys.path; it measures nothing by itself.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import zmq

from pdserve.common.wire import messages as wire
from pdserve.common.wire.auth import DeploymentKey, new_secret
from pdserve.common.sampling_params import SamplingParams
from pdserve.common.wire.messages import ErrorReply, GenerateRequest, RequestOutput, StatusRequest, StepOutputs, WorkerStatus
from pdserve.common.wire.transport import Authenticator, Client
from pdserve.router.stats.latency import RequestRecord
from pdserve.router.bench.workloads import BenchRequest
from pdserve.router.client import AsyncClient

from benchmarks.harness.paths import REPO
BLOCK_SIZE = 16
READY_TIMEOUT_S, STOP_TIMEOUT_S, RUN_TIMEOUT_S = 240.0, 30.0, 900.0
COUNTERS = ("prefix_hit_blocks", "prefix_query_blocks", "prefills")
ROUTED = ("pdserve_routed_prompt_blocks_total", "pdserve_routed_prefix_hit_blocks_total")


# ---- servers --------------------------------------------------------------------------
class Server:
    """One `pdserve serve` (router + workers) with a ready file. Owns the process, its log
    and its workers; leaving the `with` block leaves none of them running."""

    def __init__(self, name: str, model: Path, layout: list[str], routing: str, num_kv_blocks: int,
                 max_model_len: int, workdir: Path) -> None:
        self.name, self.ready_file, self.log_path = name, workdir / f"{name}.ready.json", workdir / f"{name}.log"
        self.cmd = [sys.executable, "-m", "pdserve", "serve", str(model), *layout, "--routing", routing,
                    "--http-port", "0", "--zmq-port", "0", "--ready-file", str(self.ready_file),
                    "--num-kv-blocks", str(num_kv_blocks), "--max-model-len", str(max_model_len),
                    "--block-size", str(BLOCK_SIZE), "--num-threads", "1"]
        # the deployment secret, so this harness can talk to the workers directly (0600, not argv)
        secret_file = workdir / f"{name}.secret"
        fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(new_secret())
        self.key = DeploymentKey(secret_file.read_text())
        self.cmd += ["--secret-file", str(secret_file), "--curve", "off"]  # one host, as `serve` has it by default
        self.info: dict[str, Any] = {}

    def __enter__(self) -> "Server":
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not self.ready_file.exists():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-40:])
                    raise RuntimeError(f"server {self.name} exited (code {self.proc.returncode}) or was not "
                                       f"ready in {READY_TIMEOUT_S:.0f} s:\n{tail}")
                time.sleep(0.1)
            self.info = json.loads(self.ready_file.read_text())
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # the router stops its workers, then exits
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # workers run in their own sessions: kill each by pid
                for pid in [self.proc.pid, *(w["pid"] for w in self.info.get("workers", {}).values())]:
                    with contextlib.suppress(OSError):
                        os.kill(pid, signal.SIGKILL)
                self.proc.wait()

    def workers(self, role: str) -> dict[str, str]:
        """name -> address of the workers with this role, sorted by name."""
        return {n: w["address"] for n, w in sorted(self.info["workers"].items()) if w["role"] == role}

    def counters(self) -> tuple[dict[str, dict[str, int]], dict[str, float]]:
        """Each prefill worker's COUNTERS (its WorkerStatus) and the router's ROUTED (/metrics)."""
        from prometheus_client.parser import text_string_to_metric_families
        ctx, workers = zmq.Context(), {}
        try:
            for name, address in self.workers("prefill").items():
                c = Client(ctx, address, key=self.key)
                try:
                    c.send(StatusRequest())
                    msg = c.recv(timeout_ms=30_000).msg
                finally:
                    c.close()
                if not isinstance(msg, WorkerStatus):
                    raise RuntimeError(f"worker {name} answered a status request with {msg!r}")
                workers[name] = {k: msg.counters.get(k, 0) for k in COUNTERS}
        finally:
            ctx.term()
        text = urllib.request.urlopen(self.info["http"].removesuffix("/v1") + "/metrics", timeout=30).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
        return workers, {k: samples.get(k, 0.0) for k in ROUTED}


# ---- clients, the closed-loop driver, timeline breakdown ---------------------------------
class WorkerClient(AsyncClient):
    """Talks to a decode or colocated worker directly with GenerateRequest, as the router
    does (signed with the deployment's key); reuses AsyncClient's socket and reply
    demultiplexing (workers reply one frame: a StepOutputs per loop turn, split here into
    its entries, or an ErrorReply)."""

    def __init__(self, address: str, key: DeploymentKey) -> None:
        super().__init__(address)
        self.auth = Authenticator(key, f"bench client of {address}")

    async def _read(self) -> None:
        while True:
            msg = wire.decode(self.auth.open(await self.sock.recv()))
            for out in msg.outputs if isinstance(msg, StepOutputs) else [msg]:
                q = self._queues.get(getattr(out, "request_id", ""))
                if q is not None:
                    q.put_nowait(out)

    async def stream(self, ids: list[int], max_tokens: int,  # type: ignore[override]
                     prefill_addr: str = "") -> AsyncIterator[RequestOutput]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = uuid.uuid4().hex
        q = self._queues[rid] = asyncio.Queue()
        try:
            req = GenerateRequest(rid, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                                  prefill_addr, return_timeline=True, timeline={"arrival": time.time()})
            await self.sock.send(self.auth.seal(req))
            while True:
                msg = await q.get()
                if isinstance(msg, ErrorReply):
                    raise RuntimeError(f"worker error ({msg.code}): {msg.message}")
                yield msg
                if msg.finished:
                    return
        finally:
            self._queues.pop(rid, None)


Stream = Callable[[list[int], int], AsyncIterator[RequestOutput]]


def check(recs: list[RequestRecord], reqs: list[BenchRequest], desc: str) -> None:
    bad = [i for i, (r, q) in enumerate(zip(recs, reqs)) if not r.success or r.output_len != q.output_len]
    if bad:
        r = recs[bad[0]]
        raise RuntimeError(f"{desc}: {len(bad)} of {len(recs)} requests failed or came back short; request "
                           f"{bad[0]}: {r.error or f'{r.output_len} of {reqs[bad[0]].output_len} tokens'}")


async def drive(stream: Stream, reqs: list[BenchRequest], concurrency: int, desc: str
                ) -> tuple[list[RequestRecord], float]:
    """Closed loop, `concurrency` requests in flight; the records and the wall seconds."""
    recs = [RequestRecord(0.0, prompt_len=r.prompt_len) for r in reqs]
    todo = iter(range(len(reqs)))

    async def loop() -> None:
        for i in todo:
            rec = recs[i]
            rec.send_time = time.perf_counter()
            async for out in stream(reqs[i].prompt_token_ids or [], reqs[i].output_len):
                rec.token_times += [time.perf_counter()] * len(out.token_ids)
                if out.finished:
                    rec.timeline = out.timeline

    start = time.perf_counter()
    await asyncio.wait_for(asyncio.gather(*(loop() for _ in range(concurrency))), RUN_TIMEOUT_S)
    wall = time.perf_counter() - start
    check(recs, reqs, desc)
    return recs, wall


# (segment, from stamp, to stamp); "send", "recv_first", "recv" are the client's, the rest the server's
SEGMENTS = {
    "router": (("client->router", "send", "arrival"), ("router: check, hash, route", "arrival", "routed"),
               ("router->worker", "routed", "decode_arrival"), ("worker", "decode_arrival", "finish"),
               ("worker->router", "finish", "router_done"), ("router->client", "router_done", "recv")),
    "direct": (("client->worker", "send", "decode_arrival"), ("worker", "decode_arrival", "finish"),
               ("worker->client", "finish", "recv")),
    "ttft": (("client->router", "send", "arrival"), ("router", "arrival", "routed"),  # (b), (c): router, D, P
             ("router->D", "routed", "decode_arrival"), ("D reserve", "decode_arrival", "decode_reserved"),
             ("D->P", "decode_reserved", "prefill_queued"), ("P queue", "prefill_queued", "prefill_start"),
             ("P prefill", "prefill_start", "prefill_end"), ("P->D KVReady", "prefill_end", "kv_ready"),
             ("D->router->client", "kv_ready", "recv_first")),
}


def breakdown(recs: list[RequestRecord], segments: tuple[tuple[str, str, str], ...]) -> dict[str, float | None]:
    """Mean ms of each segment of a request's path, over the records that have both stamps."""
    # the client stamps perf_counter, the server time.time(); NTP slews both alike on
    # Linux, so their offset stays put unless the wall clock is stepped
    off = time.time() - time.perf_counter()
    out = {}
    for name, a, b in segments:
        gaps = []
        for r in recs:
            t = dict(r.timeline or {}, send=r.send_time + off, recv_first=r.token_times[0] + off,
                     recv=r.token_times[-1] + off)
            if a in t and b in t:
                gaps.append(t[b] - t[a])
        out[name] = 1e3 * sum(gaps) / len(gaps) if gaps else None
    return out
