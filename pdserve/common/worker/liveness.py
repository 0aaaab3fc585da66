"""Is a process on this host alive? Used where a peer's death must be confirmed, not
guessed from silence: a worker watching its router, a decode worker watching a prefill
worker that writes straight into its memory (shm, CUDA IPC), and the other way round.

A zombie has exited (it only waits to be reaped), so it counts as dead: `os.kill(pid, 0)`
alone succeeds on one."""
from __future__ import annotations

import os
from pathlib import Path


def process_alive(pid: int) -> bool:
    """False once `pid` has exited (zombie included); True for an unknown pid (<= 0) or one
    we may not signal -- callers treat "unknown" as alive rather than free memory a live
    writer may still touch."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True  # no /proc (not Linux): signal 0 succeeded
    return state not in ("Z", "X")
