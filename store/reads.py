"""The read path: pin what a get asks for, bring disk-only entries into RAM, hand out views.

``prepare_get`` decides (which entries, which byte ranges, from which tier) and pins; the HTTP
plane (or the NIXL target) moves the bytes from ``payload_views`` and then calls
``finish_get``. Every LMDB read verifies the payload's xxh3 before a byte is copied out; a
mismatch or damaged page deletes the entry and everything that depends on it, and is answered
as a miss (``corrupt``), never as wrong bytes. A read counts as a use (eviction priority) and is
reported to ``read_hooks`` (hot-prefix replication, store/replication.py).

**Memory outside the arena.** A disk-only entry is promoted into arena pages when some can be
freed; when every page is pinned, the part of it the get asks for is read into a buffer of its
own, held until the answer is sent. Those buffers are the one way a get makes the process hold
payload bytes beyond ``ram_bytes``, so they are bounded (issue 30: four never-read gets, each
naming one disk-only 1 MiB key 200 times, took RSS from 77 to 878 MiB and kept it there):

* an entry is loaded once per get however many of its items name it (they share the buffer);
* a buffer holds the items' byte range (the span of their layer and head ranges), not the whole entry --
  ``max_get_bytes`` counts ranges, so a whole-entry load let a 4 MiB get hold 200 MiB;
* all gets together hold at most ``read_buffer_bytes``; an item past it is a miss;
* buffers are private anonymous mappings of their own whose pages are given back
  (``MADV_DONTNEED``) when the answer is done, so RSS falls back once the readers go (a bytearray
  came from the C heap, which kept it; a mapping alone is unmapped only once the last view of it
  is collected, which an exception's traceback can put off for a long while).
"""

from __future__ import annotations

import logging
import mmap
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import xxhash

from prefixstore.protocol.errors import ItemStatus, Problem
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import GetAnswer, GetItem, WireError
from .arena import Arena
from .config import StoreConfig
from .disk import Disk
from .index import Entry, Index
from .lmdb_tier import ReadOutcome
from .metrics import StoreMetrics
from .space import Space

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GetSlot:
    status: ItemStatus
    entry: Entry | None = None
    offset: int = 0
    length: int = 0
    buffer: mmap.mmap | None = None  # when the payload could not be promoted into RAM (module docstring)
    base: int = 0  # the entry's byte at which ``buffer`` starts
    checksum: int = 0
    address: int = 0  # set by prepare_get's map_disk: where the range lies in LMDB's map (pinned)
    runs: list[tuple[int, int]] | None = None
    """A head range (Namespace.payload_runs): the (offset, length) runs of the entry served, in
    order, ``length`` bytes in all; None: the one run [offset, offset + length)."""

    def ranges(self) -> list[tuple[int, int]]:
        """The (offset, length) runs of the entry this slot serves, in order."""
        return self.runs if self.runs is not None else [(self.offset, self.length)]

    def end(self) -> int:
        """The entry's byte after the last one this slot serves (its runs ascend)."""
        lo, n = self.runs[-1] if self.runs is not None else (self.offset, self.length)
        return lo + n


@dataclass(slots=True)
class GetPlan:
    slots: list[GetSlot] = field(default_factory=list)
    buffered: int = 0  # bytes of read buffers this get holds (ReadPath.buffered_bytes counts every get's)

    def answer(self) -> GetAnswer:
        """The get's answer header: status per item, size and checksum of each payload served."""
        ok = ItemStatus.OK
        return GetAnswer([s.status for s in self.slots], [s.length if s.status is ok else 0 for s in self.slots],
                         [s.checksum if s.status is ok else 0 for s in self.slots])

    @property
    def payload_bytes(self) -> int:
        return sum(s.length for s in self.slots if s.status is ItemStatus.OK)


MapDisk = Callable[[list[GetSlot]], Awaitable[list[str | None]]]
"""store/nixl_target.py's map READ: offered the disk-only slots of a get (see prepare_get)."""


SEND_BYTES = 1 << 20
"""Most bytes of one view :meth:`ReadPath.body_views` hands the HTTP plane: an asyncio transport
(Python 3.11) copies what the socket does not take at once into its own buffer, so one 64 MiB
write would be one more copy of most of the answer; 1 MiB writes keep that copy small and were
measured at raw-socket speed (docs/benchmarks.md)."""


class ReadPath:
    def __init__(self, config: StoreConfig, index: Index, arena: Arena, space: Space, disk: Disk,
                 metrics: StoreMetrics, clock: Callable[[], float]) -> None:
        self._config = config
        self._index = index
        self._arena = arena
        self._space = space
        self._disk = disk
        self._metrics = metrics
        self._clock = clock
        self.read_hooks: list[Callable[[list[Entry]], None]] = []  # called once per get with the entries it served
        self.buffered_bytes = 0  # read buffers every get in flight holds (at most config.read_buffer_bytes)

    def _byte_runs(self, ns: Namespace, e: Entry, item: GetItem, field: str, i: int) -> list[tuple[int, int]]:
        """The runs a ranged item asks for; a refusal names the range that does not exist: the
        item's (``items[i].layer_end`` / ``.head_end``) or, packed, ``layers[i]`` / ``heads[i]``."""
        is_state = e.kind is Kind.STATE
        packed = field == "layers"
        try:
            ns.payload_range(is_state, e.num_tokens, item.layer_start, item.layer_end)
        except ValueError as err:
            raise WireError(f"layers[{i}].layer_end" if packed else f"{field}[{i}].layer_end", str(err)) from None
        try:
            return ns.payload_runs(is_state, e.num_tokens, item.layer_start, item.layer_end,
                                   item.head_start, item.head_end)
        except ValueError as err:
            raise WireError(f"heads[{i}].head_end" if packed else f"{field}[{i}].head_end", str(err)) from None

    async def prepare_get(self, ns: Namespace, items: Sequence[GetItem], map_disk: MapDisk | None = None,
                          field: str = "items") -> GetPlan:
        """Pin every requested entry and bring disk-only ones into RAM (checksum verified).

        ``map_disk`` (the NIXL map READ, store/nixl_target.py) is first offered the disk-only
        slots; per slot it answers a ReadOutcome (OK: it set ``slot.address`` and
        ``slot.checksum`` and keeps the value readable in place; MISSING / CORRUPT: handled like
        a failed promotion) or None (promote it as usual). ``field``: what a refusal names (the
        request's ``items``, or ``layers`` of a packed one, protocol/wire.py).

        The caller streams the plan and must call :meth:`finish_get` (also after a refusal or a
        failure here, which release the pins themselves: the plan is not returned).

        Batch-shaped: one pass over the items pins and sizes them, and checks the byte budget
        before anything is hashed; then the partial ranges in RAM are hashed (a whole entry's
        checksum is the one it was committed with), disk-only entries are read, and the read
        hooks hear the whole batch once. A 1,024-item get of 64 KiB blocks is on the critical
        path before its first payload byte leaves, so every per-item step here shows in GET
        throughput (docs/benchmarks.md, "GET at the raw socket's speed")."""
        plan = GetPlan()
        slots = plan.slots
        entries = self._index.entries
        ns_id = ns.id
        budget = self._config.max_get_bytes
        total = 0
        ranged: list[GetSlot] = []  # partial ranges of entries in RAM: hashed once the budget holds
        disk: list[GetSlot] = []
        try:
            for i, item in enumerate(items):
                key = item.key
                e = entries.get(key[:1] + ns_id + key[1:])  # index.scope(ns_id, key), inlined: per item
                if e is None or e.record:  # a fork record holds no payload: its block is on its branch node
                    slots.append(GetSlot(ItemStatus.MISSING))
                    continue
                runs = None
                if item.whole:
                    offset, length = 0, e.size
                else:
                    runs = self._byte_runs(ns, e, item, field, i)
                    offset, length = runs[0][0], sum(n for _, n in runs)
                    if len(runs) == 1:
                        runs = None
                total += length
                if total > budget:
                    raise WireError("keys" if field == "layers" else "items",
                                    f"asks for more than max_get_bytes={budget}; split the batch", Problem.TOO_LARGE)
                e.pins += 1
                slot = GetSlot(ItemStatus.OK, e, offset, length, runs=runs)
                slots.append(slot)
                if e.pages is None:
                    if e.dead:
                        slot.status = ItemStatus.MISSING
                    else:
                        disk.append(slot)
                elif length == e.size:
                    slot.checksum = e.checksum
                else:
                    ranged.append(slot)
            for slot in ranged:
                assert slot.entry is not None and slot.entry.pages is not None  # pinned: never demoted
                slot.checksum = self._arena.checksum_runs(slot.entry.pages, slot.ranges())
            if disk:
                await self._from_disk(disk, map_disk, plan)
        except BaseException:
            self.finish_get(plan)
            raise
        now = self._clock()
        served: list[Entry] = []
        requeue = self._space.requeue
        for slot in slots:
            e = slot.entry
            if slot.status is not ItemStatus.OK or e is None:
                continue
            e.last_access_s = now
            if not e.dead:
                requeue(e, now)
            served.append(e)
        for hook in self.read_hooks:
            hook(served)
        return plan

    async def _from_disk(self, disk: list[GetSlot], map_disk: MapDisk | None, plan: GetPlan) -> None:
        """The slots of a get whose entries are on disk only: offered to ``map_disk`` first, the
        rest promoted into RAM (or read into a buffer), each entry once, verified; their
        checksums set."""
        mapped: list[str | None] = list(await map_disk(disk)) if map_disk is not None else []
        mapped += [None] * (len(disk) - len(mapped))
        groups: dict[int, list[GetSlot]] = {}  # id(entry) -> its slots still to load, in order
        for slot, outcome in zip(disk, mapped):
            e = slot.entry
            assert e is not None
            if outcome == ReadOutcome.OK:
                continue  # map_disk set its checksum
            if outcome is not None:
                slot.status = await self._read_failed(e, outcome)
                continue
            groups.setdefault(id(e), []).append(slot)
        for group in groups.values():
            e = group[0].entry
            assert e is not None
            if e.pages is None:  # else promoted by a concurrent read meanwhile
                status = ItemStatus.MISSING if e.dead else await self._load(e, group, plan)
                if status is not ItemStatus.OK:
                    for slot in group:
                        slot.status = status
                    continue
            for slot in group:
                if slot.offset == 0 and slot.length == e.size:
                    slot.checksum = e.checksum
                elif slot.buffer is not None:
                    h = xxhash.xxh3_64()
                    for view in self.payload_views(slot):
                        h.update(view)
                    slot.checksum = h.intdigest()
                else:
                    assert e.pages is not None
                    slot.checksum = self._arena.checksum_runs(e.pages, slot.ranges())

    def payload_views(self, slot: GetSlot) -> list[memoryview]:
        assert slot.entry is not None
        if slot.buffer is not None:
            base = slot.base
            return [memoryview(slot.buffer)[lo - base : lo - base + n] for lo, n in slot.ranges()]
        assert slot.entry.pages is not None
        pages = slot.entry.pages
        return [view for lo, n in slot.ranges() for view in self._arena.runs(pages, lo, n)]

    def body_views(self, plan: GetPlan) -> list[memoryview]:
        """Every served payload of a get, in order, as few views as the arena allows: the ranges
        of entries in adjacent pages merged into one view (a 64 MiB get of 64 KiB blocks stored
        together goes out as a handful of writes, not 1024)."""
        out: list[memoryview] = []
        run: list[tuple[int, int]] = []
        arena = self._arena
        page_bytes = arena.page_bytes if not arena.virtual else 0
        for slot in plan.slots:
            if slot.status is not ItemStatus.OK:
                continue
            e = slot.entry
            assert e is not None
            pages = e.pages
            if slot.buffer is not None or pages is None:
                out += arena.coalesce(run, SEND_BYTES)
                run = []
                out += self.payload_views(slot)
            elif slot.runs is not None:  # a head range: one run per layer and component
                for lo, n in slot.runs:
                    run += arena.extents(pages, lo, n)
            elif len(pages) == 1 and page_bytes:  # the common 64 KiB block: its one extent, no generator
                start = pages[0] * page_bytes + slot.offset
                run.append((start, start + slot.length))
            else:
                run += arena.extents(pages, slot.offset, slot.length)
        out += arena.coalesce(run, SEND_BYTES)
        return out

    def finish_get(self, plan: GetPlan) -> None:
        for slot in plan.slots:
            if slot.entry is not None:
                self._space.unpin(slot.entry)
                slot.entry = None
            if slot.buffer is not None:
                # Sent (or cut off): its pages go back now; the mapping goes with its last view.
                slot.buffer.madvise(mmap.MADV_DONTNEED)
                slot.buffer = None
        self.buffered_bytes -= plan.buffered
        plan.buffered = 0

    async def _load(self, e: Entry, slots: list[GetSlot], plan: GetPlan) -> ItemStatus:
        """Bring a disk-only entry in for ``slots`` (the get's items naming it), verified: promoted
        whole into RAM; or, when no arena page can be freed, the slots' byte range read into one
        buffer they share, within ``read_buffer_bytes`` (a miss past it)."""
        tier = self._disk.tier
        assert tier is not None and e.on_disk
        pages = self._space.allocate(e.size)
        base = 0
        buffer = None
        if pages is not None:
            dest = list(self._arena.runs(pages, 0, e.size))
        else:
            base = min(s.offset for s in slots)
            n = max(s.end() for s in slots) - base
            if self.buffered_bytes + n > self._config.read_buffer_bytes or n == 0:
                self._metrics.read_buffer_refusals.inc(len(slots))
                return ItemStatus.MISSING
            buffer = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            self.buffered_bytes += n  # before the read: finish_get gives it back whatever happens
            plan.buffered += n
            dest = [memoryview(buffer)]
        try:
            outcome = await tier.read_into(e.key, e.size, e.checksum, dest, base)
        except BaseException:  # cancelled (the client went away) or the tier failed: the pages go back
            if pages is not None:
                self._arena.free(pages)
            raise
        if outcome != ReadOutcome.OK:
            if pages is not None:
                self._arena.free(pages)
            return await self._read_failed(e, outcome)
        if pages is None:
            for slot in slots:
                slot.buffer, slot.base = buffer, base
            return ItemStatus.OK
        if e.dead or e.pages is not None:  # deleted (a miss), or promoted by a concurrent read meanwhile
            self._arena.free(pages)
            return ItemStatus.MISSING if e.pages is None else ItemStatus.OK
        self._index.set_tier(e, pages, True)
        return ItemStatus.OK

    async def _read_failed(self, e: Entry, outcome: str) -> ItemStatus:
        """An LMDB read of ``e`` found it missing or corrupt: delete it (and its dependants)."""
        if outcome == ReadOutcome.CORRUPT:
            self._metrics.checksum_failures.labels("disk").inc()
            log.warning("checksum mismatch (or damage) reading %s from LMDB; deleting it", e.key.hex())
        if not e.dead:
            self._space.delete(e, "corrupt")
            await self._disk.flush()
        return ItemStatus.CORRUPT if outcome == ReadOutcome.CORRUPT else ItemStatus.MISSING


__all__ = ["GetPlan", "GetSlot", "MapDisk", "ReadPath"]
