"""The one clock the router, the workers' timers and the request timelines read.

Every reading of time that a decision depends on (a heartbeat due, a lease expired, a
peer silent too long, a worker stale, a request's TTFT) goes through a `Clock` handed to
the object that decides, never through `time` directly. Production code uses
`SYSTEM_CLOCK`; a test or a discrete-event simulator hands a `ManualClock` and moves it
forward itself, so the same router and worker code runs in simulated time. The
engine's scheduler and block manager read no time at all: what runs next depends on
tokens, blocks and arrival order only.

Two readings, as in `time`: `time()` is wall-clock seconds since the epoch (timeline
stamps: stamps taken in different processes of one host compare), `monotonic()` is for
intervals and deadlines (never jumps back).
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
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
    """Time that moves only when its driver moves it. `advance` moves it and wakes every
    task whose `sleep_async` deadline it passed (in deadline order), as a discrete-event
    simulator's clock does; `next_deadline` says how far the next sleeper wants it moved.
    A synchronous `sleep` has nothing else to wait for: it advances by the time slept.
    `time()` is `monotonic()` plus a fixed epoch offset, so both readings move together."""

    def __init__(self, start: float = 0.0, epoch: float = 1.7e9) -> None:
        self.now = start
        self.epoch = epoch
        self._sleepers: list[tuple[float, int, asyncio.Future]] = []  # heap of (deadline, order, future)
        self._order = itertools.count()

    def time(self) -> float:
        return self.epoch + self.now

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self.now += seconds
        while self._sleepers and self._sleepers[0][0] <= self.now:
            _, _, fut = heapq.heappop(self._sleepers)
            if not fut.done():  # a cancelled sleeper is simply dropped
                fut.set_result(None)

    def next_deadline(self) -> float | None:
        """When the earliest sleeping task wants to wake (monotonic seconds), or None."""
        while self._sleepers and self._sleepers[0][2].done():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    def sleep(self, seconds: float) -> None:
        self.advance(max(0.0, seconds))

    async def sleep_async(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)  # still a suspension point, as a real zero sleep is
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._sleepers, (self.now + seconds, next(self._order), fut))
        await fut
