"""kill -9 of the router (`pdserve serve`): every worker exits within the detection time
(--router-timeout 1) plus 5 s, releasing its ports and its shared memory."""
from __future__ import annotations

import glob
import signal
from pathlib import Path

from tests.support.reliability_harness import _children, serve, wait_gone


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm files process `pid` has mapped: this deployment's segments, whatever
    other deployments on the host (other tests, other users) create meanwhile."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split(maxsplit=5)[5] for line in maps
            if len(line.split(maxsplit=5)) == 6 and line.split(maxsplit=5)[5].startswith("/dev/shm/pdserve-")}


def test_kill_router_workers_exit(tmp_path):
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"])
    workers = [w["pid"] for w in served.info["workers"].values()]
    assert set(workers) <= _children(served.proc.pid)
    segments = set().union(*(mapped_segments(pid) for pid in workers))
    assert segments, "the decode worker's KV cache should be a shared-memory segment"
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait()
    took = wait_gone(workers, timeout=1 + 5)
    assert took < 6
    left = [s for s in segments if glob.glob(s)]
    assert not left, f"shared memory left behind: {left}"
