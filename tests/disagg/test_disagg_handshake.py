"""A decode worker whose KV layout or backend does not match its prefill peer is refused
at connect time: it exits non-zero with a message naming what differs, and the prefill
worker keeps running."""
from __future__ import annotations

import time
import uuid

import pytest

from pdserve.router.launch.local import LaunchError, Launcher, WorkerProcess
from tests.support.disagg_driver import engine_options, shm_segments, start_worker


@pytest.fixture(scope="module")
def prefill(model_dirs, tmp_path_factory):
    """One shm prefill worker with 16-token blocks, met by each mismatched decode worker."""
    launcher = Launcher(tmp_path_factory.mktemp("handshake"))
    try:
        p = start_worker(launcher, f"p-{uuid.uuid4().hex[:6]}", "prefill", model_dirs["qwen3"],
                         {**engine_options(), "kv_transfer": "shm"})
        launcher.wait_ready([p])
        yield launcher, p
    finally:
        launcher.stop()


# name -> (model arch, decode options, words the refusal must contain)
CASES = {
    "block_size": ("qwen3", {**engine_options(block_size=32), "kv_transfer": "shm"},
                   ["block_size", "prefill has 16", "decode has 32"]),
    "backend": ("qwen3", {**engine_options(), "kv_transfer": "tcp"}, ["backend", "'shm'", "'tcp'"]),
    "model": ("llama", {**engine_options(), "kv_transfer": "shm"}, ["model_fingerprint"]),
    # the same model at bfloat16 (bf16 KV, another fingerprint) against a float32 prefill worker
    "dtype": ("qwen3", {**engine_options(), "dtype": "bfloat16", "kv_transfer": "shm"},
              ["dtype", "prefill has 'float32'", "decode has 'bfloat16'"]),
    # shared memory between two hosts (another host id: common/worker/host.py) cannot work
    "host": ("qwen3", {**engine_options(), "kv_transfer": "shm", "host_id": "another-machine"},
             ["'shm' shares memory", "on two", "'another-machine'", "--kv-transfer tcp"]),
}


@pytest.fixture(scope="module")
def refused(prefill, model_dirs):
    """refused(case) -> the decode worker of `case`, run to its exit. Every case's worker
    starts at once (on 2 cores, about half the wall time of one after the other)."""
    launcher, p = prefill
    workers = {case: start_worker(launcher, f"d-{case}-{uuid.uuid4().hex[:6]}", "decode", model_dirs[arch],
                                  {**flags, "prefill_peers": (p.address,)})
               for case, (arch, flags, _) in CASES.items()}
    for d in workers.values():
        with pytest.raises(LaunchError):
            launcher.wait_ready([d], timeout=120)
        d.proc.wait(timeout=30)
    return workers.__getitem__


def _wait_for_no_shm(d: WorkerProcess, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while shm_segments(d) and time.monotonic() < deadline:  # a resource tracker may do it late
        time.sleep(0.1)


@pytest.mark.parametrize("case", list(CASES))
def test_mismatched_decode_worker_is_refused(case, refused, prefill):
    _, p = prefill
    d = refused(case)
    assert d.proc.returncode not in (0, None)
    log = d.log_tail()
    assert "refused this decode worker" in log, log
    for word in CASES[case][2]:
        assert word in log, f"{word!r} missing from the decode worker's error:\n{log}"
    assert "Traceback" not in log, f"a refusal is a user error, not a crash:\n{log}"
    assert p.proc.poll() is None, f"the prefill worker died:\n{p.log_tail()}"
    _wait_for_no_shm(d)
    assert not shm_segments(d), "a refused decode worker left its shm KV cache behind"


def test_refused_decode_worker_removes_its_own_shm_cache(refused):
    """The shm segment D created is D's to unlink when its start fails; left to Python's
    resource tracker it goes only at exit, with a 'leaked shared_memory' warning."""
    d = refused("block_size")
    _wait_for_no_shm(d)
    log = d.log_tail()
    assert "leaked shared_memory" not in log, log
