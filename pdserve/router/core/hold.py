"""Requests held for a worker: where nothing can serve a request (router/core/availability.py,
plan "none"), it waits for a worker to register or to be heard again, up to its deadline,
holding its admission slot -- so the wait is bounded in time and in number, never an
unbounded queue."""
from __future__ import annotations

import asyncio

from pdserve.common.clock import Clock


class WorkerWait:
    """Owns the count of requests waiting for a worker and the signal that wakes them: a
    worker registered or was heard (a heartbeat), so routing may find one now."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.held = 0  # requests waiting now
        self._changed = asyncio.Event()  # replaced at every change: a waiter holds the one it waits on

    def changed(self) -> None:
        """The pools changed for the better: every held request looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait(self, seconds: float) -> None:
        """Until the next change or `seconds` of the clock, whichever comes first; counted
        as held meanwhile."""
        woke = asyncio.ensure_future(self._changed.wait())
        timer = asyncio.ensure_future(self.clock.sleep_async(seconds))
        self.held += 1
        try:
            await asyncio.wait({woke, timer}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.held -= 1
            woke.cancel()
            timer.cancel()
