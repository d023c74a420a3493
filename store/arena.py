"""The RAM arena: one preallocated region split into fixed-size pages.

One region means one NIXL registration and no fragmentation outside a page;
the byte budget is a hard cap because nothing else ever allocates payload
memory. An entry is a list of page indices; its bytes are the concatenation
of those pages, truncated to the entry's size::

    region: | p0 | p1 | p2 | p3 | ... | p(N-1) |
    entry A = [p3, p4, p1]  (size <= 3 * page_bytes)

Allocation takes the lowest free indices first (a heap), so a quiet arena
hands out contiguous runs and reads coalesce them into single slices.
"""

from __future__ import annotations

import heapq
import mmap
import sys
from collections.abc import Iterator, Sequence

import numpy as np
import xxhash


# Linux >= 5.14; Python 3.11's mmap module does not name it yet.
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else -1)


_PRIVATE = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)


class ArenaFull(Exception):
    """Not enough free pages; the caller evicts or rejects."""


class Arena:
    """``virtual=True`` keeps the page accounting without the memory: the trace
    simulator replays through the same store code at real model sizes (GiBs)
    without allocating or copying them."""

    def __init__(self, total_bytes: int, page_bytes: int, virtual: bool = False) -> None:
        self.page_bytes = page_bytes
        self.num_pages = total_bytes // page_bytes
        self.virtual = virtual
        # One anonymous mapping: untouched pages cost nothing until prefault()
        # (or the first write) maps them in. Private, not mmap's default MAP_SHARED: shared
        # anonymous memory is shmem, which Linux backs with transparent huge pages only where
        # shmem_enabled allows (off by default), and with 4 KiB pages a NIXL READ of the arena
        # spent a third longer walking pages (docs/benchmarks.md, "Huge pages for the arena"). Nothing
        # forks with the arena, so private loses nothing.
        self._map = mmap.mmap(-1, max(1, 0 if virtual else self.num_pages * page_bytes), flags=_PRIVATE)
        self.region = np.frombuffer(self._map, dtype=np.uint8)[: 0 if virtual else self.num_pages * page_bytes]
        self.view = self.region.data.cast("B")
        self._free: list[int] = [] if virtual else list(range(self.num_pages))  # a heap
        self._num_free = self.num_pages

    def prefault(self) -> bool:
        """Map every page in now (a background thread at start-up), so the first
        puts do not pay a page fault per 4 KiB. MADV_POPULATE_WRITE populates
        without writing, so it is safe while puts already fill pages. Returns
        False where the kernel or platform lacks it (then pages fault lazily)."""
        if self.virtual or not hasattr(self._map, "madvise"):
            return False
        try:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                self._map.madvise(mmap.MADV_HUGEPAGE)
            self._map.madvise(_MADV_POPULATE_WRITE)
        except OSError:
            return False
        return True

    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def capacity_bytes(self) -> int:
        return self.num_pages * self.page_bytes

    def pages_for(self, size: int) -> int:
        return max(1, -(-size // self.page_bytes))

    def allocate(self, size: int) -> list[int]:
        n = self.pages_for(size)
        if n > self._num_free:
            raise ArenaFull(f"{n} pages wanted, {self._num_free} free")
        if self.virtual:  # no memory behind the pages: one element stands for n pages
            self._num_free -= n
            return [-n]
        pages = [heapq.heappop(self._free) for _ in range(n)]
        self._num_free -= n
        return pages

    def free(self, pages: Sequence[int]) -> None:
        if self.virtual:
            self._num_free += -sum(pages)
            return
        for p in pages:
            heapq.heappush(self._free, p)
        self._num_free += len(pages)

    def extents(self, pages: Sequence[int], offset: int, length: int) -> Iterator[tuple[int, int]]:
        """(start, end) byte offsets in the region covering bytes [offset, offset+length) of an
        entry, consecutive pages merged."""
        if self.virtual:
            return
        pb = self.page_bytes
        end = offset + length
        first, last = offset // pb, (end - 1) // pb if length else offset // pb - 1
        i = first
        while i <= last:
            j = i
            while j < last and pages[j + 1] == pages[j] + 1:
                j += 1
            base = pages[i] * pb - i * pb
            yield base + max(offset, i * pb), base + min(end, (j + 1) * pb)
            i = j + 1

    def runs(self, pages: Sequence[int], offset: int, length: int) -> Iterator[memoryview]:
        """Memoryviews covering bytes [offset, offset+length) of an entry, consecutive pages merged."""
        view = self.view
        for lo, hi in self.extents(pages, offset, length):
            yield view[lo:hi]

    def coalesce(self, extents: Sequence[tuple[int, int]], max_bytes: int = 0) -> list[memoryview]:
        """Views of consecutive extents (several entries' payloads, in order), each run of extents
        that follow one another back to back in the region merged into one view of at most
        ``max_bytes`` (0: no bound): a batch of entries in adjacent pages moves as a few large
        buffers, not one per entry."""
        out: list[memoryview] = []
        view = self.view
        lo = hi = -1
        for a, b in extents:
            if a == hi and (not max_bytes or b - lo <= max_bytes):
                hi = b
                continue
            if hi > lo:
                out.append(view[lo:hi])
            lo, hi = a, b
        if hi > lo:
            out.append(view[lo:hi])
        return out

    def write(self, pages: Sequence[int], offset: int, data: bytes | memoryview) -> None:
        pos = 0
        for run in self.runs(pages, offset, len(data)):
            n = len(run)
            run[:] = data[pos : pos + n]
            pos += n

    def read(self, pages: Sequence[int], size: int) -> bytes:
        return b"".join(bytes(r) for r in self.runs(pages, 0, size))

    def checksum(self, pages: Sequence[int], offset: int, length: int) -> int:
        return self.checksum_runs(pages, [(offset, length)])

    def checksum_runs(self, pages: Sequence[int], ranges: Sequence[tuple[int, int]]) -> int:
        """xxh3 of the entry's byte ranges (offset, length), concatenated in order: what a ranged
        read of them (a head range: one range per layer and component) delivers."""
        h = xxhash.xxh3_64()
        for offset, length in ranges:
            for run in self.runs(pages, offset, length):
                h.update(run)
        return h.intdigest()
