"""A loop the router runs on its event loop beside the requests (the supervisor, the pool
control plane, the planner, the Ray pool's watch): `start` makes it a task, `close`
cancels it."""
from __future__ import annotations

import asyncio


class Background:
    """Subclasses write `_loop`, which runs until cancelled."""

    _task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _loop(self) -> None:
        raise NotImplementedError
