"""A private event loop on a daemon thread, shared by both roles: the scheduler's lookups
(one per tensor-parallel rank, concurrently) and the worker's loads and saves run there while
the engine computes.

Where that thread runs matters as much as what it does. vLLM's CPU workers pin their whole
process to the engine's OpenMP cores (``VLLM_CPU_OMP_THREADS_BIND``: every thread of the worker,
ours included, inherits it), so a thread started there competes for the very core the forward
pass runs on: measured under concurrent load (benchmarks/vllm_serving.py, wide model,
concurrency 8), a decode step with a load in flight took 1.23-1.43x one without. The loop's
thread therefore moves itself to the CPUs the engine's parent process may use, less the ones the
engine is pinned to when any remain (:func:`transfer_cpus`): 1.02x in the same run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from typing import Any

from ..client import PrefixClient
from ..sync import end_other_tasks

log = logging.getLogger(__name__)


def transfer_cpus(own: set[int], parent: set[int]) -> set[int]:
    """The CPUs the client loop's thread runs on: those of the engine's parent process (vLLM's
    engine core, never pinned) less the engine's own (this process's pinning), or all of the
    parent's where the engine holds them all."""
    return (parent - own) or parent or own


class ClientLoop:
    """A private event loop on a daemon thread: loads and saves run there while the engine computes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.cpus: set[int] | None = None
        """The CPUs the loop's thread was moved to (None: left where it started)."""
        self._thread = threading.Thread(target=self._run, name="prefixstore-vllm", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            own = os.sched_getaffinity(0)
            cpus = transfer_cpus(own, os.sched_getaffinity(os.getppid()))
            if cpus != own:
                os.sched_setaffinity(0, cpus)  # 0: this thread (Linux affinity is per thread)
                self.cpus = cpus
        except (AttributeError, OSError) as err:  # no affinity calls here (macOS), or not allowed
            log.debug("prefixstore client loop stays on its CPUs: %s", err)
        self.loop.run_forever()

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
        try:
            self.submit(end_other_tasks()).result(timeout=10)
        except Exception as err:  # noqa: BLE001 -- shutting down: nothing left to protect
            log.debug("prefixstore client loop tasks: %s", err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


__all__ = ["ClientLoop", "transfer_cpus"]
