"""The one clock the router, the workers' timers and the request timelines read.

Every reading of time that a decision depends on (a heartbeat due, a lease expired, a
peer silent too long, a worker stale, a request's TTFT) goes through a `Clock` handed to
the object that decides, never through `time` directly. Production code uses
`SYSTEM_CLOCK`; a test or a discrete-event simulator hands a `ManualClock` and moves it
forward itself, so the same router and worker code runs in simulated time.

Two readings, as in `time`: `time()` is wall-clock seconds since the epoch (timeline
stamps: stamps taken in different processes of one host compare), `monotonic()` is for
intervals and deadlines (never jumps back).
"""
from __future__ import annotations

import asyncio
import time


class Clock:
    """The system's clock."""

    def time(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    async def sleep_async(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


SYSTEM_CLOCK = Clock()


class ManualClock(Clock):
    """Time that moves only when its driver moves it (`advance`, or a sleep, which
    advances by the time slept and returns at once). `time()` is `monotonic()` plus a
    fixed epoch offset, so wall-clock and monotonic readings move together."""

    def __init__(self, start: float = 0.0, epoch: float = 1.7e9) -> None:
        self.now = start
        self.epoch = epoch

    def time(self) -> float:
        return self.epoch + self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self.now += seconds

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    async def sleep_async(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))
        await asyncio.sleep(0)  # still a suspension point: other tasks run, as after a real sleep
