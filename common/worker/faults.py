"""Fault injection as configuration, off by default: the reliability tests (and anyone
reproducing a failure) set `PDSERVE_FAULTS` in a worker's environment.

    PDSERVE_FAULTS="kill_after_prefill=1@prefill-0,delay_transfer_ms=3000"

Entries are `name=value`, comma-separated; `name=value@worker_id` applies to that worker
only. Counting faults fire once, at the Nth occurrence (1-based) in that worker:

| name | worker | what happens at the Nth occurrence |
| --- | --- | --- |
| kill_after_prefill=N | prefill | the Nth finished prompt: SIGKILL itself before KVReady |
| kill_mid_transfer=N | prefill | the Nth step that writes KV layer by layer: SIGKILL itself after half the layers |
| kill_mid_decode=N | decode | after sending its Nth token: SIGKILL itself |
| drop_transfer=N | prefill | the Nth KVReady is never sent (a lost transfer) |
| corrupt_transfer=N | prefill | the Nth transfer's checksum does not match its data (as if bytes flipped) |
| delay_transfer_ms=MS | prefill | KVReady of transfer `delay_transfer_at` (default 1) waits MS ms (a slow writer) |
| delay_step_ms=MS | decode | every step waits MS ms first (a slow worker: a long output outlasts a test's timeouts) |
"""
from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field, fields

from common.config import ConfigError

ENV_VAR = "PDSERVE_FAULTS"


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
    seen: dict[str, int] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str, worker_id: str) -> "Faults":
        names = {f.name for f in fields(cls)} - {"seen"}
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
        return cls.parse(os.environ.get(ENV_VAR, ""), worker_id)

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
