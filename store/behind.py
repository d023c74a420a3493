"""Write-behind: committed entries persisted to LMDB after they became visible (``durability =
"write-behind"``, the default; ``sync`` writes through at commit instead, store/writes.py).

::

    commit --> index (visible, in RAM, checksummed) --> queue --writer task--> one LMDB txn per batch
                                                          |                        |
                      a commit waits here while the queue is over its bounds       v
                      (write_behind_bytes, write_behind_s): back-pressure     on_disk, RAM queue

The writer takes every queued entry (up to :data:`TXN_BYTES`) into one transaction, so the
number of transactions follows the disk's pace, not the number of commits. Bounded: a commit
waits while the entries behind hold more than ``write_behind_bytes`` (at most half the arena)
or the oldest of them was committed more than ``write_behind_s`` ago; the bytes behind live in
arena pages the entries hold anyway, so memory never grows with the lag.

Rules: an entry not yet on disk is never demoted (it is in no RAM queue until it is, store/space.py:
``requeue`` queues only ``on_disk`` entries), so its only copy stays in RAM. It may be deleted
meanwhile (capacity, a flush, a corruption cascade): a dead entry is skipped, and one deleted while
its transaction was in flight (pinned by the writer: its pages stay valid under the write) is
deleted from LMDB right after. A write that fails deletes its entries (a miss, never wrong bytes);
one the tier's reset overtook finds them dropped already. ``close`` drains the queue.

A write that finds the disk full (:class:`TierFull`, store/disk.py) wrote nothing: its entries go
back to the head of the queue with their commit times, stay visible (served from RAM, never
demoted), and the writer tries again every ``FULL_RETRY_S``. Commits go on while the queue is
within its bounds; past them ``room`` refuses instead of waiting (a commit would otherwise wait
for as long as the disk stays full), so a full disk costs new saves, never what was committed.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Sequence

from .arena import Arena
from .config import StoreConfig
from .disk import FULL_RETRY_S, Disk
from .index import Entry, Index
from .lmdb_tier import StoredRecord, TierFull
from .metrics import StoreMetrics
from .space import Space

log = logging.getLogger(__name__)

TXN_BYTES = 64 << 20
"""Most payload bytes the writer puts in one LMDB transaction (one entry more when it alone is larger)."""


def record_of(e: Entry) -> StoredRecord:
    """What LMDB keeps of an entry beside its payload."""
    return StoredRecord(key=e.key, namespace_id=e.namespace_id, parent=e.parent, start=e.start, tokens=e.tokens,
                        extra=e.extra, container=e.container, boundary=e.boundary, size=e.size,
                        checksum=e.checksum, origin=e.origin, record=e.record, branch=e.branch)


def puts_of(arena: Arena, entries: Sequence[Entry]) -> list[tuple[StoredRecord, list[memoryview]]]:
    """Records and payload views (the entries' arena pages, no copy) of one LMDB transaction."""
    return [(record_of(e), list(arena.runs(e.pages or [], 0, e.size))) for e in entries]


def _died(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("the LMDB write-behind stopped: %r; commits wait on it and fail from now on", task.exception())


class WriteBehind:
    def __init__(self, config: StoreConfig, index: Index, arena: Arena, space: Space, disk: Disk,
                 metrics: StoreMetrics, clock: Callable[[], float]) -> None:
        self._index = index
        self._arena = arena
        self._space = space
        self._disk = disk
        self._metrics = metrics
        self._clock = clock
        self.enabled = config.durability == "write-behind"
        self.max_bytes = min(config.write_behind_bytes, config.ram_bytes // 2)
        self.max_s = config.write_behind_s
        self._queue: deque[tuple[Entry, float]] = deque()  # committed, not yet taken by the writer
        self._in_flight: list[Entry] = []
        self._in_flight_since = 0.0  # commit time of the oldest entry in flight
        self.bytes = 0  # charged bytes (payloads and records) of the entries queued and in flight
        self.entries = 0
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ what commit uses

    def add(self, entries: Sequence[Entry]) -> None:
        """Queue committed (indexed, visible) entries, in commit order."""
        now = self._clock()
        for e in entries:
            self._queue.append((e, now))
            self.bytes += e.charge
        self.entries += len(entries)
        self._wake.set()

    def lag_s(self) -> float:
        """Seconds since the oldest entry behind was committed (0: none behind)."""
        oldest = self._in_flight_since if self._in_flight else (self._queue[0][1] if self._queue else None)
        return 0.0 if oldest is None else max(0.0, self._clock() - oldest)

    def over(self) -> bool:
        return self.entries > 0 and (self.bytes > self.max_bytes or self.lag_s() > self.max_s)

    async def room(self) -> bool:
        """Back-pressure: True once the entries behind are within both bounds; False, at once, while
        they are not and the disk is full (the caller refuses the commit)."""
        if not self.over():
            return True
        if self._disk.full:
            return False
        self._metrics.write_behind_waits.inc()
        while self.over():
            if self._task is None or self._task.done():
                raise RuntimeError("the LMDB write-behind task is not running")
            if self._disk.full:
                return False
            progress = self._progress
            await progress.wait()
        return True

    # ------------------------------------------------------------ the writer

    def start(self) -> None:
        if self.enabled and self._disk.enabled and self._task is None:
            self._task = asyncio.create_task(self._run(), name="lmdb-write-behind")
            self._task.add_done_callback(_died)

    async def drain(self) -> None:
        """Return once every entry committed so far is written (or found deleted), or once a write
        found the disk full (what is behind then waits for space)."""
        while self.entries and self._task is not None and not self._task.done() and not self._disk.full:
            progress = self._progress
            await progress.wait()

    async def close(self) -> None:
        """Drain, then stop the writer."""
        if self._task is None:
            return
        await self.drain()
        if self.entries:
            log.error("%d committed entries (%d bytes) were never written to LMDB, its disk being full: they end "
                      "with the process (misses after the restart)", self.entries, self.bytes)
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._task = None

    def _take(self) -> list[tuple[Entry, float]]:
        batch: list[tuple[Entry, float]] = []
        size = 0
        while self._queue and (not batch or size + self._queue[0][0].size <= TXN_BYTES):
            e, committed_s = self._queue.popleft()
            if e.dead:  # deleted before it was written: nothing to persist
                self._settle(e)
                continue
            if not batch:
                self._in_flight_since = committed_s
            e.pins += 1  # its pages stay valid under the write, whatever deletes it meanwhile
            batch.append((e, committed_s))
            size += e.size
        return batch

    def _settle(self, e: Entry) -> None:
        self.bytes -= e.charge
        self.entries -= 1

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
            taken = self._take()
            self._in_flight = [e for e, _ in taken]
            full = False
            try:
                if taken:
                    full = not await self._write(taken)
            finally:
                self._in_flight = []
                progress, self._progress = self._progress, asyncio.Event()
                progress.set()
            if full:
                await asyncio.sleep(FULL_RETRY_S)

    async def _write(self, taken: list[tuple[Entry, float]]) -> bool:
        """One transaction of the queue's head; False when the disk was full (the batch requeued)."""
        batch = [e for e, _ in taken]
        written: bool | None
        self._metrics.write_behind_txns.inc()
        try:
            written = await self._disk.write(puts_of(self._arena, batch))
        except asyncio.CancelledError:
            for e in batch:
                self._space.unpin(e)
            raise
        except TierFull:  # nothing written: back to the head of the queue, in order, commit times kept
            for e in batch:
                self._space.unpin(e)
            self._queue.extendleft(reversed(taken))
            return False
        except Exception as err:
            log.exception("LMDB write-behind of %d entries failed (%s); they are deleted (misses)", len(batch),
                          type(err).__name__)
            written = None
        persisted = 0
        for e in batch:
            self._space.unpin(e)
            self._settle(e)
            if e.dead:  # deleted while in flight: take it off the disk too
                if written:
                    self._disk.doom(e.key)
                continue
            if written:
                self._space.persisted(e)
                persisted += 1
            else:  # not on disk: its RAM copy must not be demoted to nothing; a miss from now on
                self._space.delete(e, "unpersisted")
        self._metrics.write_behind_written.inc(persisted)
        return True

    # ------------------------------------------------------------ checking

    def behind(self) -> list[Entry]:
        """The live entries not yet on disk (Store.check)."""
        return [e for e, _ in self._queue if not e.dead] + [e for e in self._in_flight if not e.dead]


__all__ = ["TXN_BYTES", "WriteBehind", "puts_of", "record_of"]
