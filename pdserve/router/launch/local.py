"""Starting and stopping worker processes. Each worker gets its config as data: the
launcher writes its WorkerSpec (common.worker.spec) as a JSON file (mode 0600) in its
workdir and starts `python -m pdserve.prefill_node --config FILE` (decode and colocated roles:
`python -m pdserve.decode_node`). A worker writes a ready file once its socket is bound; the
launcher waits for every ready file and on stop terminates (then kills) every process it
started, leaving no orphans."""
from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from pdserve.common.wire.auth import new_secret
from pdserve.common.worker.spec import WorkerSpec


class LaunchError(RuntimeError):
    """A worker exited or did not become ready; the message carries its stderr tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class WorkerProcess:
    """A started worker: its process, its log file and (once ready) its ready info."""

    name: str
    proc: subprocess.Popen
    ready_file: Path
    log_path: Path
    spec: WorkerSpec | None = None  # what it was started with (a restart starts it again)
    info: dict = field(default_factory=dict)
    reaped: bool = False  # its exit was reported by `reap`

    @property
    def address(self) -> str:
        return self.info["address"]

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Launcher:
    """Owns the worker processes of one deployment (tests, `pdserve serve`) and hands each
    the deployment's secret (a fresh one unless given) through its config file only, and
    whether the deployment encrypts its sockets (`curve`: every worker must agree)."""

    def __init__(self, workdir: str | Path | None = None, secret: str = "", curve: bool = False) -> None:
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="pdserve-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)  # config files hold the secret; logs hold prompts
        self.workers: list[WorkerProcess] = []
        self.secret = secret or new_secret()
        self.curve = curve

    def start(self, spec: WorkerSpec, env: dict | None = None) -> WorkerProcess:
        """Start the worker `spec` describes, named by its worker_id; the launcher sets
        its ready file, the deployment secret (in the file, never in argv or env) and, unless
        one is set, this process as the router it watches (it exits when this process is gone)."""
        name = spec.worker.worker_id
        ready = self.workdir / f"{name}.ready"
        ready.unlink(missing_ok=True)
        log_path = self.workdir / f"{name}.log"
        spec = dataclasses.replace(spec, worker=dataclasses.replace(
            spec.worker, ready_file=str(ready), secret=self.secret, curve=self.curve,
            router_pid=spec.worker.router_pid or os.getpid()))
        config_path = spec.write(self.workdir / f"{name}.json")
        package = "pdserve.prefill_node" if spec.worker.role == "prefill" else "pdserve.decode_node"
        cmd = [sys.executable, "-m", package, "--config", str(config_path)]
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                    start_new_session=True)  # its own group: Ctrl-C goes to us first
        wp = WorkerProcess(name, proc, ready, log_path, spec)
        self.workers = [w for w in self.workers if w.name != name] + [wp]  # a restart replaces its entry
        return wp

    def reap(self) -> list[WorkerProcess]:
        """Workers that exited since the last call (reaped: no zombie is left for a peer's
        liveness check to mistake for a live process)."""
        gone = []
        for wp in self.workers:
            if not wp.reaped and wp.proc.poll() is not None:
                wp.reaped = True
                gone.append(wp)
        return gone

    def wait_ready(self, workers: list[WorkerProcess] | None = None, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        for wp in workers or self.workers:
            while not wp.ready_file.exists():
                if wp.proc.poll() is not None:
                    raise LaunchError(f"worker {wp.name} exited with code {wp.proc.returncode}:\n{wp.log_tail()}")
                if time.monotonic() > deadline:
                    raise LaunchError(f"worker {wp.name} not ready after {timeout:.0f} s:\n{wp.log_tail()}")
                time.sleep(0.05)
            wp.info = json.loads(wp.ready_file.read_text())

    def stop(self, timeout: float = 10.0) -> None:
        for wp in self.workers:
            if wp.proc.poll() is None:
                wp.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for wp in self.workers:
            try:
                wp.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(wp.proc.pid, signal.SIGKILL)
                wp.proc.wait()
        self.workers = []

    def __enter__(self) -> "Launcher":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
