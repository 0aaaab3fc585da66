"""kill -9 of the router (`pdserve serve`): every worker exits within the detection time
(--router-timeout 1) plus 5 s, releasing its ports and its shared memory."""
from __future__ import annotations

import glob
import signal

from tests.reliability.harness import _children, serve, wait_gone


def test_kill_router_workers_exit(tmp_path):
    before = set(glob.glob("/dev/shm/pdserve-decode-0-*"))  # other deployments' segments on this host
    served = serve(tmp_path, ["--prefill", "1", "--decode", "1"])
    workers = [w["pid"] for w in served.info["workers"].values()]
    assert set(workers) <= _children(served.proc.pid)
    segments = set(glob.glob("/dev/shm/pdserve-decode-0-*")) - before
    assert segments
    served.proc.send_signal(signal.SIGKILL)
    served.proc.wait()
    took = wait_gone(workers, timeout=1 + 5)
    assert took < 6
    left = [s for s in segments if glob.glob(s)]
    assert not left, f"shared memory left behind: {left}"
