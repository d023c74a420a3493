"""A private event loop on a daemon thread, shared by both roles: the scheduler's lookups
(one per tensor-parallel rank, concurrently) and the worker's loads and saves run there while
the engine computes."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from typing import Any

from ..client import PrefixClient

log = logging.getLogger(__name__)


class ClientLoop:
    """A private event loop on a daemon thread: loads and saves run there while the engine computes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefixstore-vllm", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, *clients: PrefixClient | None) -> None:
        for client in clients:
            if client is None:
                continue
            try:
                self.submit(client.close()).result(timeout=10)
            except Exception as err:  # noqa: BLE001 -- shutting down: nothing left to protect
                log.debug("prefixstore client close: %s", err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


__all__ = ["ClientLoop"]
