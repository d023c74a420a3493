"""Background tasks of the store (sweeper, membership refresh, replication, NIXL progress)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop_task(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has stopped; None is nothing to stop."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
