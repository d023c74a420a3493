"""A blocking face of :class:`PrefixClient`, for engines and scripts without an event loop.

One daemon thread runs a private event loop; each method submits the async
client's coroutine to it and waits for the result. The async client does all
the work (and keeps its contract: store failures become misses or dropped
saves, never exceptions), so this file holds no protocol logic.

Running the loop on its own thread, rather than ``asyncio.run`` per call,
keeps the frame transport's keep-alive connections across calls, and
works when the calling thread already runs a loop of its own (that loop is
blocked for the duration of the call, as with any blocking I/O).

Callbacks handed to :meth:`save` (``kv_payload``) run on the client's loop
thread; they must not call back into this client (that would wait on
itself, so it raises instead).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import TypeVar

import numpy as np

from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec
from .client import Buffer, PrefixClient
from .config import ClientConfig
from .prompt import Prompt
from .results import LookupResult, SaveResult

T = TypeVar("T")


async def end_other_tasks(timeout_s: float = 5.0) -> None:
    """Cancel every task of the running loop but this one and wait (up to ``timeout_s``) for them
    to end. For a private loop about to be stopped and closed: a task left pending there leaves
    its suspended coroutine to the garbage collector, which finalises it later on whatever thread
    it runs on (CPython 3.11 crashed doing that here, in ``gen_close``, with aiohttp's WebSocket
    coroutines among the garbage)."""
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me and not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout_s)


class SyncPrefixClient:
    """Blocking twin of :class:`PrefixClient`: same methods, same results, no ``await``.

    Use as a context manager, or call :meth:`close` when done::

        with SyncPrefixClient(ns, ClientConfig(url="http://127.0.0.1:8077")) as client:
            res = client.lookup(tokens)
    """

    def __init__(self, namespace: Namespace, config: ClientConfig | None = None) -> None:
        self._client = PrefixClient(namespace, config)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="prefixstore-client", daemon=True)
        self._thread.start()
        self._lock = threading.Lock()  # guards closing against concurrent calls
        self._closed = False
        self._background: list[concurrent.futures.Future[bool]] = []  # prepare_in_background's, cancelled at close

    # ------------------------------------------------------------ plumbing

    def _run(self, coro: Coroutine[object, object, T]) -> T:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("SyncPrefixClient called from its own loop thread (e.g. inside a save "
                               "callback); that call would wait on itself")
        with self._lock:
            if self._closed:
                coro.close()
                raise RuntimeError("SyncPrefixClient is closed")
            future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        # Every request inside is bounded by ClientConfig.timeout_s, so this returns.
        return future.result()

    def __enter__(self) -> SyncPrefixClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the HTTP session and stop the loop thread. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for future in self._background:
            future.cancel()  # a set-up still waiting on a store that does not answer: not waited for
        try:
            asyncio.run_coroutine_threadsafe(self._client.close(), self._loop).result()
        finally:
            try:
                asyncio.run_coroutine_threadsafe(end_other_tasks(), self._loop).result(timeout=10)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join()
                self._loop.close()

    # ------------------------------------------------------------ the async client's API

    @property
    def namespace(self) -> Namespace:
        return self._client.namespace

    @property
    def config(self) -> ClientConfig:
        return self._client.config

    @property
    def failures(self) -> collections.Counter[str]:
        """Failures by operation, as counted by the async client (a live view)."""
        return self._client.failures

    @property
    def data_path(self) -> str:
        """'nixl', 'http' or 'undecided' (see PrefixClient.data_path)."""
        return self._client.data_path

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved by path (a live view)."""
        return self._client.path_bytes

    def register_buffer(self, buf: Buffer) -> bool:
        return self._client.register_buffer(buf)

    def unregister_buffer(self, buf: Buffer) -> bool:
        return self._client.unregister_buffer(buf)

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return self._client.prompt(tokens, extra_keys)

    def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        return self._run(self._client.lookup(prompt, lease))

    def release(self, lease_id: bytes | None) -> bool:
        return self._run(self._client.release(lease_id))

    def prepare(self) -> bool:
        return self._run(self._client.prepare())

    def prepare_in_background(self) -> concurrent.futures.Future[bool]:
        """:meth:`prepare` without waiting for it: an engine starting up hands the set-up (importing
        nixl, making the agent, loading the store's) to the client's thread and goes on, so a store
        that is down does not hold its start, and its first save does not pay the set-up
        (docs/nixl.md, "An engine's first save"). The future says whether payloads will take NIXL;
        :meth:`close` cancels it if it is still running."""
        with self._lock:
            if self._closed:
                raise RuntimeError("SyncPrefixClient is closed")
            future = asyncio.run_coroutine_threadsafe(self._client.prepare(), self._loop)
            self._background.append(future)
        return future

    def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]:
        return self._run(self._client.read(items, outs))

    def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        return self._run(self._client.offer(items))

    def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        return self._run(self._client.put(items, commit))

    def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
             snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
             origins: Mapping[int, int] | None = None) -> SaveResult:
        return self._run(self._client.save(prompt, kv_upto, kv_payload, snapshots, start, origins))


__all__ = ["SyncPrefixClient", "end_other_tasks"]
