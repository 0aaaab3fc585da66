"""The Ray actor that runs one worker on the node Ray placed it on (router/launch/ray.py
starts it). It imports neither torch nor Ray's driver side: the worker process it starts
loads the engine, the actor only owns that process.

The actor is given the worker's spec (common/worker/spec.py's file format, without the
secret), the path of the secret file and the router's control address. It reads the
secret on its node, completes the spec for where it runs -- the node's address to bind,
host id `ray:<node id>`, the router to report to, itself as the parent to watch -- and
starts `python -m pdserve.prefill_node|decode_node --config /dev/stdin` (the command router/
launch.py runs), writing the spec into the worker's stdin: the secret is never on disk,
so an actor killed at any moment leaves none behind.

The worker watches its actor as its parent (WorkerConfig.parent_pid): when Ray kills the
actor, or loses its node, the worker stops. It reaches the router as a joined worker does
(common/worker/router_link.py): when the router actor dies it gives up that router's
requests, and it says hello again to the router Ray restarts at the same address, which
adopts this actor by its name (router/launch/ray.py). When the worker exits, the actor
stays and says so through `exit_code`; the router decides (router/pools/ray_pool.py's RayPool): a
worker drained by the router (code 0) has its actor ended for good; a failed one has its
actor killed for Ray to restart both -- unless it keeps failing before it registers,
then it is ended for good and reported failed. A worker that exits before it is ready
fails this actor's creation (Ray does not restart that): the router reports it failed.
The actor is detached (owned by the cluster, not by the router actor that created it), so
it outlives its router; the deployment's clean stop ends it."""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from pdserve.common.wire.auth import read_secret_file


class WorkerStartError(RuntimeError):
    """The worker exited, or was not ready in time, before it served."""


def worker_command(role: str, config: str) -> list[str]:
    """The command of one worker of `role` (as router/launch/local.py runs it)."""
    return [sys.executable, "-m", "pdserve.prefill_node" if role == "prefill" else "pdserve.decode_node", "--config", str(config)]


class WorkerActor:
    """One worker on this node: owns its process, reports where it runs, and exits when
    the worker does."""

    def __init__(self, spec: dict, secret_file: str, control: str, ready_timeout_s: float) -> None:
        import ray
        self.node_id = ray.get_runtime_context().get_node_id()
        self.worker_id = spec["worker"]["worker_id"]
        try:
            secret = read_secret_file(secret_file)
        except ValueError as e:
            raise WorkerStartError(f"{e} (the secret file must be present at this path on every Ray node)") from None
        workdir = Path(tempfile.mkdtemp(prefix="pdserve-ray-"))  # 0700, for the worker's ready file
        self.worker = dict(spec["worker"], bind=f"tcp://{ray.util.get_node_ip_address()}:0",
                           host_id=f"ray:{self.node_id}", report_to=control, parent_pid=os.getpid(),
                           ready_file=str(workdir / "ready.json"))
        self._stopping = False
        try:
            # its output goes where this actor's goes: Ray's logs, streamed to the driver
            self.proc = subprocess.Popen(worker_command(self.worker["role"], "/dev/stdin"), stdin=subprocess.PIPE,
                                         env=dict(os.environ, PYTHONUNBUFFERED="1"))
            with contextlib.suppress(BrokenPipeError):  # it exited first: _wait_ready says so
                with self.proc.stdin:
                    self.proc.stdin.write(json.dumps(dict(spec, worker=dict(self.worker, secret=secret))).encode())
            self.ready = self._wait_ready(Path(self.worker["ready_file"]), ready_timeout_s)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        threading.Thread(target=self._watch, name="watch-worker", daemon=True).start()

    def __repr__(self) -> str:  # Ray prefixes this actor's log lines with it
        return f"PdserveWorker({self.worker_id})"

    def _wait_ready(self, ready: Path, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while not ready.exists():
            if self.proc.poll() is not None:
                raise WorkerStartError(f"worker {self.worker_id} exited with code {self.proc.returncode} before it "
                                       f"was ready (its output is in this actor's Ray log)")
            if time.monotonic() > deadline:
                self.proc.kill()
                self.proc.wait()
                raise WorkerStartError(f"worker {self.worker_id} not ready after {timeout:.0f} s")
            time.sleep(0.05)
        return json.loads(ready.read_text())

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._stopping:
            print(f"pdserve: worker {self.worker_id} exited with code {code}: its actor waits for the driver "
                  f"(it ends it, or has Ray start both again)", file=sys.stderr, flush=True)

    def exit_code(self) -> int | None:
        """The worker's exit code once it has exited (this actor stays until the driver
        ends or restarts it), else None."""
        return self.proc.poll()

    def info(self) -> dict:
        """The worker's ready info (address, pid, blocks), who it is, where it runs, and
        whether it was told to stop (a router that adopts this actor finishes that stop)."""
        return dict(self.ready, worker_id=self.worker_id, role=self.worker["role"], node_id=self.node_id,
                    host_id=self.worker["host_id"], kv_transfer=self.worker["kv_transfer"], actor_pid=os.getpid(),
                    stopping=self._stopping)

    def stop(self, timeout_s: float) -> int:
        """SIGTERM the worker (it drains, WorkerConfig.drain_s), SIGKILL after `timeout_s`;
        its exit code."""
        self._stopping = True
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()
