"""common/clock.py: the system clock reads `time`; a manual clock moves only when driven."""
from __future__ import annotations

import asyncio
import time

import pytest

from common.clock import SYSTEM_CLOCK, ManualClock


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


def test_manual_clock_async_sleep_advances_and_yields():
    clock = ManualClock()
    order: list[str] = []

    async def sleeper() -> None:
        await clock.sleep_async(3.0)
        order.append(f"slept to {clock.monotonic()}")

    async def other() -> None:
        order.append("other ran")

    async def main() -> None:
        await asyncio.gather(sleeper(), other())

    asyncio.run(main())
    assert order == ["other ran", "slept to 3.0"]
