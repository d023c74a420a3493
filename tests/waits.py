"""Waiting on a condition in a test, with a bound: never a fixed sleep (a sleep long enough on a
loaded machine is a slow test everywhere else, and one too short is a flaky test)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


async def wait_until(predicate: Callable[[], bool], what: str, deadline_s: float = 20.0, step_s: float = 0.01) -> None:
    """Return once ``predicate()`` holds; fail naming ``what`` if it does not within ``deadline_s``.
    The loop runs between checks, so background tasks the condition waits on make progress."""
    end = time.monotonic() + deadline_s
    while not predicate():
        assert time.monotonic() < end, f"not within {deadline_s}s: {what}"
        await asyncio.sleep(step_s)


__all__ = ["wait_until"]
