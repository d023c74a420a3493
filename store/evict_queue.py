"""A priority queue of eviction candidates with lazy invalidation.

An eviction policy is a priority function (admission/); the queue orders
candidates by it, lowest first. Re-prioritising an entry pushes a new heap
item and forgets the old one by sequence number, so every update is
O(log n) with no search; stale items are skipped when they surface and the
heap is rebuilt when they outnumber the live ones.

Why not an intrusive LRU list: candidates enter in arbitrary priority order
(a parent becomes deletable when its last child goes, carrying its own older
timestamp), and FLOP-aware policies are not recency-ordered at all.

Pinned entries are skipped, not dropped: they stay queued and become
candidates again as soon as their pins are released.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from .index import Entry


class EvictionQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Entry]] = []
        self._live: dict[bytes, int] = {}  # entry key -> sequence of its current heap item
        self._seq = itertools.count()

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, e: Entry) -> bool:
        return e.key in self._live

    def update(self, e: Entry, priority: float) -> None:
        seq = next(self._seq)
        self._live[e.key] = seq
        heapq.heappush(self._heap, (priority, seq, e))
        if len(self._heap) > 4 * len(self._live) + 1024:
            self._compact()

    def discard(self, e: Entry) -> None:
        self._live.pop(e.key, None)

    def pop(self, usable: Callable[[Entry], bool]) -> tuple[Entry, float] | None:
        """Remove and return the lowest-priority live entry for which ``usable`` holds, with its priority."""
        skipped: list[tuple[float, int, Entry]] = []
        found: tuple[Entry, float] | None = None
        while self._heap:
            item = heapq.heappop(self._heap)
            priority, seq, e = item
            if self._live.get(e.key) != seq:
                continue
            if usable(e):
                del self._live[e.key]
                found = (e, priority)
                break
            skipped.append(item)
        for item in skipped:
            heapq.heappush(self._heap, item)
        return found

    def _compact(self) -> None:
        self._heap = [item for item in self._heap if self._live.get(item[2].key) == item[1]]
        heapq.heapify(self._heap)
