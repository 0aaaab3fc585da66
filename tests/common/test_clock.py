"""common/clock.py: the system clock reads `time`; a manual clock moves only when driven."""
from __future__ import annotations

import asyncio
import time

import pytest

from pdserve.common.clock import SYSTEM_CLOCK, ManualClock


def test_system_clock_reads_time():
    before_wall, before_mono = time.time(), time.monotonic()
    wall, mono = SYSTEM_CLOCK.time(), SYSTEM_CLOCK.monotonic()
    assert before_wall <= wall <= time.time()
    assert before_mono <= mono <= time.monotonic()


def test_manual_clock_moves_only_when_driven():
    clock = ManualClock(start=5.0, epoch=1000.0)
    assert (clock.monotonic(), clock.time()) == (5.0, 1005.0)
    clock.advance(2.5)
    assert (clock.monotonic(), clock.time()) == (7.5, 1007.5)
    clock.sleep(0.5)  # returns at once, time moved by what was slept
    assert clock.monotonic() == 8.0
    with pytest.raises(ValueError, match="does not go back"):
        clock.advance(-1)
    assert clock.monotonic() == 8.0


def test_manual_clock_wakes_async_sleepers_when_driven_past_their_deadlines():
    clock = ManualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, seconds: float) -> None:
        await clock.sleep_async(seconds)
        woke.append((name, clock.monotonic()))

    async def main() -> None:
        tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("b", 2.0), ("a", 1.0), ("c", 5.0))]
        await asyncio.sleep(0)  # every sleeper registered
        assert clock.next_deadline() == 1.0
        clock.advance(0.5)
        await asyncio.sleep(0)
        assert woke == []  # nobody's deadline passed
        clock.advance(1.6)  # to 2.1: a and b, in deadline order
        await asyncio.sleep(0)
        assert woke == [("a", 2.1), ("b", 2.1)] and clock.next_deadline() == 5.0
        tasks[2].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert clock.next_deadline() is None  # a cancelled sleeper is dropped

    asyncio.run(main())
