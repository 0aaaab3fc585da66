"""Timing a benchmark phase on a shared machine: wall seconds, this process's CPU
seconds, and the share of the machine's CPU other processes took meanwhile (from
/proc/stat), which says whether a timing is clean."""
from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass(frozen=True)
class Throughput:
    """Tokens over wall seconds. cpu_seconds is this process's CPU time (all threads);
    other_cpu_share is the part of the machine's CPU that other processes used meanwhile
    (0 on an idle machine), which says whether the timing is clean."""

    output_tokens: int
    seconds: float
    cpu_seconds: float
    other_cpu_share: float | None

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds

    def as_dict(self) -> dict[str, float | None]:
        return {**asdict(self), "tokens_per_s": self.tokens_per_s}


def _machine_jiffies() -> tuple[int, int] | None:
    """(busy, total) CPU jiffies of the whole machine since boot, from /proc/stat."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


class Phase:
    """Times a region: wall seconds, this process's CPU seconds, and the share of the
    machine's CPU that other processes took meanwhile."""

    def __enter__(self) -> "Phase":
        self.jiffies0 = _machine_jiffies()
        self.cpu0, self.t0 = time.process_time(), time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0
        self.cpu_seconds = time.process_time() - self.cpu0
        j1, self.other_cpu_share = _machine_jiffies(), None
        if self.jiffies0 and j1 and j1[1] > self.jiffies0[1]:
            busy, total = j1[0] - self.jiffies0[0], j1[1] - self.jiffies0[1]
            ours = self.cpu_seconds * os.sysconf("SC_CLK_TCK")
            self.other_cpu_share = max(0.0, (busy - ours) / total)

    def result(self, tokens: int) -> Throughput:
        return Throughput(tokens, self.seconds, self.cpu_seconds, self.other_cpu_share)
