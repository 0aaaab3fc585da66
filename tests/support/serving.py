"""Helpers for the `pdserve serve` end-to-end tests: the workload they share, start and
stop the real command (checking that no worker process survives it), and a raw client that
speaks the protocol of docs/protocol.md with nothing but pyzmq and msgpack."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING
from pathlib import Path
from typing import Iterator

import msgpack
import pytest
import zmq

from pdserve.common.wire.messages import PROTOCOL_VERSION
from pdserve.common.text.tokenizer import Tokenizer
import urllib.error
import urllib.request

if TYPE_CHECKING:
    import openai

ROOT = Path(__file__).resolve().parents[2]

REAL_MAX_MODEL_LEN = 256  # the real model's deployments: a long chat runs to it (test_what_agent_sdks_send)


# ---- the workload ---------------------------------------------------------------------

MAX_MODEL_LEN = 512
MAX_NEW = 12
PROMPTS = ["The router sends each request to", "Hello, my name is",
           "A prefill worker computes the prompt and the decode worker streams tokens back to the client "
           "through the router, which measures latency and throughput for every request in the queue"]
CHAT = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": "Which worker decodes?"}]


def chat_ids(tok: Tokenizer, messages: list[dict]) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages))


def expected_reason(tokens: list[int], max_new: int) -> str:
    return "length" if len(tokens) == max_new else "stop"


# ---- starting and stopping `pdserve serve` --------------------------------------------

@dataclass
class Served:
    """A running `pdserve serve` and what its ready file says."""

    proc: subprocess.Popen
    info: dict
    log: Path
    model_dir: str

    @property
    def http(self) -> str:
        return self.info["http"]

    @property
    def base(self) -> str:
        return self.info["http"].removesuffix("/v1")

    @property
    def zmq(self) -> str:
        return self.info["zmq"]

    @property
    def worker_pids(self) -> list[int | None]:
        """Worker pids as the ready file names them (None where it does not)."""
        return [w.get("pid") for w in self.info["workers"].values()]

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def _pdserve() -> list[str]:
    # `python -m pdserve` rather than the `pdserve` script: the script runs whichever
    # checkout the environment was installed from, the module the one on sys.path
    return [sys.executable, "-m", "pdserve"]


def start_server(model_dir: str, workdir: Path, roles: list[str], max_model_len: int, timeout: float = 150.0,
                 faults: str | None = None, extra: tuple[str, ...] = ()) -> Served:
    """`pdserve serve` started and ready; `faults` is its PDSERVE_FAULTS (docs/reliability.md);
    `extra`: more flags."""
    ready = workdir / "ready.json"
    log = workdir / "serve.log"
    cmd = [*_pdserve(), "serve", model_dir, *roles, "--http-port", "0", "--zmq-port", "0",
           "--num-kv-blocks", "256", "--max-model-len", str(max_model_len), "--num-threads", "1",
           "--dtype", "float32", "--ready-file", str(ready), *extra]  # exactness is judged at float32
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", **({"PDSERVE_FAULTS": faults} if faults else {})))
    served = Served(proc, {}, log, model_dir)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            pytest.fail(f"pdserve serve exited with {proc.returncode}:\n{served.log_tail()}")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.fail(f"pdserve serve not ready after {timeout:.0f} s:\n{served.log_tail()}")
        time.sleep(0.1)
    served.info = json.loads(ready.read_text())
    assert served.info["pid"] == proc.pid
    return served


@contextlib.contextmanager
def serving_pd(model_dir: str, workdir: Path, max_model_len: int, timeout: float = 150.0,
               faults: str | None = None, extra: tuple[str, ...] = ()) -> Iterator[Served]:
    """One prefill + one decode worker behind the router, checked ready; stopped with SIGTERM."""
    served = start_server(model_dir, workdir, ["--prefill", "1", "--decode", "1"], max_model_len, timeout, faults,
                          extra)
    try:
        check_ready_file_workers(served, {"prefill-0": "prefill", "decode-0": "decode"})
        yield served
    finally:
        stop_server(served, signal.SIGTERM)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie has exited; it only waits to be reaped
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return {int(x) for x in out.split()}


def stop_server(served: Served, sig: int = signal.SIGTERM) -> None:
    """Signal the serve process, wait for it, and check that every worker is gone."""
    children = _children(served.proc.pid)  # the workers, as the OS sees them
    served.proc.send_signal(sig)
    try:
        rc = served.proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        served.proc.kill()
        served.proc.wait()
        rc = None
    named = {p for p in served.worker_pids if p is not None}
    deadline = time.monotonic() + 5
    while any(_alive(p) for p in children | named) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(p for p in children | named if _alive(p))
    for p in left:  # do not leak them into the rest of the session
        os.kill(p, signal.SIGKILL)
    name = signal.Signals(sig).name
    assert rc == 0, f"pdserve serve did not stop cleanly on {name} (rc {rc}):\n{served.log_tail()}"
    assert not left, f"worker processes {left} survived {name} to pdserve serve"
    assert named <= children, f"the ready file names pids {named} that serve did not start (children {children})"


def check_ready_file_workers(served: Served, roles: dict[str, str]) -> None:
    """The ready file names each worker with its role, address and pid."""
    workers = served.info["workers"]
    assert set(workers) == set(roles), workers
    for name, role in roles.items():
        w = workers[name]
        assert w.get("role") == role and str(w.get("address", "")).startswith("tcp://") and \
               isinstance(w.get("pid"), int), f"ready file entry for {name} is incomplete: {w!r}"


# ---- a raw client from docs/protocol.md: pyzmq + msgpack only --------------------------

class RawClient:
    """DEALER socket, one msgpack frame per message, {"v", "type", "data"} envelope."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(address)
        self.stash: dict[str, list[dict]] = {}  # messages read while waiting for another request's

    def send(self, type_: str, data: dict) -> None:
        self.sock.send(msgpack.packb({"v": PROTOCOL_VERSION, "type": type_, "data": data}))

    def submit(self, sampling: dict, **fields) -> str:
        rid = fields.pop("request_id", None) or uuid.uuid4().hex
        self.send("submit", {"request_id": rid, "sampling": sampling, **fields})
        return rid

    def recv(self, timeout_s: float = 60.0) -> dict:
        assert self.sock.poll(int(timeout_s * 1000)), "no reply from the router"
        msg = msgpack.unpackb(self.sock.recv())
        assert set(msg) == {"v", "type", "data"} and msg["v"] == PROTOCOL_VERSION, msg
        return msg

    def until_done(self, rid: str) -> list[dict]:
        """Every message of request `rid`, up to its final token_output or error."""
        got = self.stash.pop(rid, [])
        while not got or not (got[-1]["type"] == "error" or got[-1]["data"]["finished"]):
            msg = self.recv()
            if msg["data"].get("request_id") == rid:
                got.append(msg)
            else:
                self.stash.setdefault(msg["data"].get("request_id"), []).append(msg)
        return got

    def next_error(self) -> dict:
        """The next error reply; token_outputs read meanwhile are kept for until_done."""
        while True:
            msg = self.recv()
            if msg["type"] == "error":
                return msg
            self.stash.setdefault(msg["data"]["request_id"], []).append(msg)

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def openai_client(served: "Served", timeout: float = 120) -> "openai.OpenAI":
    """The official openai client on a deployment's HTTP front end (no retries: a test
    sees the first answer)."""
    import openai
    return openai.OpenAI(base_url=served.http, api_key="unused", max_retries=0, timeout=timeout)


def served_model(client: "openai.OpenAI") -> str:
    """The served model's id, as an OpenAI client finds it (an unknown model is a 404)."""
    return client.models.list().data[0].id


def colocated_server(model_dir: str, workdir: Path, max_model_len: int) -> Iterator[Served]:
    """One colocated worker's `pdserve serve`, for a fixture to `yield from`: stopped
    (SIGTERM) at the fixture's teardown, whatever happened."""
    served = start_server(model_dir, workdir, ["--colocated", "1", "--prefill", "0", "--decode", "0"], max_model_len)
    try:
        yield served
    finally:
        with contextlib.suppress(Exception):
            stop_server(served, signal.SIGTERM)


def _health(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return json.load(r)
    except urllib.error.HTTPError as e:
        return json.load(e)
    except OSError:
        return None


def _wait_ok(url: str, procs: list[subprocess.Popen], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (h := _health(url)) is None or h["status"] != "ok":
        assert all(p.poll() is None for p in procs), "a process exited"
        assert time.monotonic() < deadline, f"not ok after {timeout:.0f} s: {h}"
        time.sleep(0.2)
