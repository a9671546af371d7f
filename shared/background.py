"""Background asyncio tasks (the producer link's checks, auto's probes): stopping one whatever it raised."""

from __future__ import annotations

import asyncio
import contextlib


async def stop_task(task: asyncio.Task | None) -> None:
    """Cancel a background task and wait for it to end (whatever it raised)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
