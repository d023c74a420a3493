"""Space: the RAM arena's pages and the LMDB budget, eviction and deletion.

Owns the two eviction queues and is the one place entries leave the store::

    allocate(size) --RAM short--> LMDB tier: demote the lowest-priority unpinned RAM entry
                                  (it stays on disk; free)   RAM only: delete a leaf
    enforce_disk_budget          --> delete the lowest-priority unpinned leaves
    delete(e, reason)            --> e and everything that depends on it, leaves first

Invariants kept here: a pinned entry (lease, in-flight read, pending anchor) is never evicted or
demoted; an entry deleted while pinned keeps its pages until its last pin drops (``unpin``), so a
stream in progress never sends reused bytes; deletion is leaf-first, so a snapshot goes before its
block and no orphan is left (store/index.py).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

from prefixstore.admission import AdmissionPolicy, EvictionPolicy
from prefixstore.protocol.keys import Kind
from .arena import Arena, ArenaFull
from .disk import Disk
from .evict_queue import EvictionQueue
from .index import Entry, Index, IndexInvariantError
from .ledger import TenantLedger
from .metrics import StoreMetrics
from .namespaces import Namespaces


def _unpinned(e: Entry) -> bool:
    return e.pins == 0


class Space:
    def __init__(self, index: Index, arena: Arena, disk: Disk, namespaces: Namespaces, ledger: TenantLedger,
                 admission: Mapping[Kind, AdmissionPolicy], eviction: EvictionPolicy, metrics: StoreMetrics,
                 clock: Callable[[], float], disk_bytes: int, max_entries: int) -> None:
        self.index = index
        self.arena = arena
        self._disk = disk
        self._namespaces = namespaces
        self._ledger = ledger
        self._admission = admission
        self._eviction = eviction
        self._metrics = metrics
        self._clock = clock
        self._disk_bytes = disk_bytes
        self._max_entries = max_entries
        self.on_delete: list[Callable[[Entry], None]] = []  # told of each entry leaving (replication's books)
        self.ram_queue = EvictionQueue()  # committed, in RAM and on disk: a RAM drop is free
        self.delete_queue = EvictionQueue()  # committed leaves: candidates for deletion

    def charge(self, e: Entry, sign: int) -> None:
        """Count an entry's payload against its tenant (+1 taken, -1 given back)."""
        ns = self._namespaces.find(e.namespace_id)
        if ns is not None:
            self._ledger.charge(ns, sign * e.charge, sign)

    def allocate(self, size: int) -> list[int] | None:
        """Arena pages for ``size`` bytes, evicting unpinned entries as needed; None if impossible."""
        need = self.arena.pages_for(size)
        if need > self.arena.num_pages or not self.make_room(need):
            return None
        try:
            return self.arena.allocate(size)
        except ArenaFull:  # pragma: no cover - make_room guarantees room
            return None

    def make_room(self, pages: int) -> bool:
        """Free arena pages until ``pages`` are free: LMDB tier, demote the lowest-priority unpinned
        RAM entries (they stay on disk); RAM only, delete leaves. False when pins forbid it (what
        was freed stays free). A put makes room for its whole batch in one call."""
        if self.arena.num_free >= pages:
            return True
        demoted: dict[str, int] = {}
        try:
            while self.arena.num_free < pages:
                if self._disk.enabled:
                    popped = self.ram_queue.pop(_unpinned)
                    if popped is None:
                        return False
                    v, priority = popped
                    assert v.pages is not None
                    self.arena.free(v.pages)
                    self.index.set_tier(v, None, True)
                    self._eviction.on_evict(v, priority, self._clock())
                    mk = v.metric_kind
                    demoted[mk] = demoted.get(mk, 0) + 1
                else:
                    popped = self.delete_queue.pop(_unpinned)
                    if popped is None:
                        return False
                    self.evict(*popped)
            return True
        finally:
            for mk, n in demoted.items():
                self._metrics.evictions.labels(mk, "demoted").inc(n)

    def enforce_disk_budget(self, incoming: int) -> bool:
        """Delete leaves until ``incoming`` more charged bytes (payloads and records) fit in
        ``disk_bytes``; False if pins forbid it."""
        while self.index.disk_charge() + incoming > self._disk_bytes:
            popped = self.delete_queue.pop(lambda e: e.pins == 0)
            if popped is None:
                return False
            self.evict(*popped)
        return True

    def enforce_entry_budget(self, incoming: int) -> bool:
        """Delete leaves until ``incoming`` more entries fit in ``max_entries`` (the index's memory
        is bounded by count, not only by payload bytes); False if pins forbid it."""
        while len(self.index.entries) + incoming > self._max_entries:
            popped = self.delete_queue.pop(lambda e: e.pins == 0)
            if popped is None:
                return False
            self.evict(*popped)
        return True

    def evict(self, victim: Entry, priority: float) -> None:
        """Delete a capacity victim (a leaf) and tell the policies."""
        now = self._clock()
        self._eviction.on_evict(victim, priority, now)
        self._admission[victim.kind].on_evict(victim.kind, victim.num_hits, now, victim.origin)
        self.delete(victim, "capacity")

    def delete(self, e: Entry, reason: str) -> None:
        """Remove ``e`` and everything that depends on it, leaves first."""
        for x in self.index.subtree(e):
            up = self.index.remove(x)
            self.charge(x, -1)
            self.ram_queue.discard(x)
            self.delete_queue.discard(x)
            if x.on_disk:
                self._disk.doom(x.key)
            if x.pins == 0 and x.pages is not None:
                self.arena.free(x.pages)
                x.pages = None
            self._metrics.evictions.labels(x.metric_kind, reason).inc()
            for hook in self.on_delete:
                hook(x)
            if up is not None and up.committed and up.is_leaf:
                # Its priority from its own last access: becoming a leaf is not a use.
                self.delete_queue.update(up, up.priority)

    def drop_all(self, reason: str, namespaces: Collection[bytes] | None = None) -> int:
        """Delete every committed entry (admin flush, a damaged tier), or every one of the namespaces
        given (admin delete); returns how many. Deleting the entries whose parent is their root or
        not held (a cluster's foreign parents) takes everything below them. Pending puts stay
        pending and are refused at commit ("parent or container gone")."""
        before = len(self.index.entries)
        for e in list(self.index.entries.values()):
            if namespaces is not None and e.namespace_id not in namespaces:
                continue
            if e.kind is not Kind.STATE and not e.dead and e.key in self.index.entries \
                    and (e.parent == self._namespaces.root(e.namespace_id)
                         or (e.parent is not None and self.index.get_block(e.namespace_id, e.parent) is None)):
                self.delete(e, reason)
        return before - len(self.index.entries)

    def unpin(self, e: Entry) -> None:
        """Drop one pin; the pages of an entry removed while pinned are freed with its last pin. (A
        pending put's entry is never dead: dropping it takes it out of pending first.)"""
        e.pins -= 1
        if e.pins < 0:
            raise IndexInvariantError(f"entry {e.key.hex()}: unpinned more often than pinned")
        if e.pins == 0 and e.dead and e.pages is not None and not e.committed:
            self.arena.free(e.pages)
            e.pages = None

    def persisted(self, e: Entry) -> None:
        """A committed entry reached LMDB (write-behind, store/behind.py): from now on its RAM copy
        may be demoted. Not a use: its priority stays what its commit made it."""
        self.index.set_tier(e, e.pages, True)
        if e.pages is not None:
            self.ram_queue.update(e, e.priority)

    def requeue(self, e: Entry, now: float) -> None:
        """Recompute an entry's priority (a store or a read is a use) and queue it where it belongs."""
        priority = e.priority = self._eviction.priority(e, now)
        if e.pages is not None and e.on_disk:
            self.ram_queue.update(e, priority)
        if e.is_leaf:
            self.delete_queue.update(e, priority)

    def check(self, holders: list[Entry], behind: Collection[Entry] = ()) -> None:
        """Arena accounting and queue membership (``holders``: every entry holding pages; ``behind``:
        committed entries the write-behind has not written yet, store/behind.py)."""
        if self.arena.virtual:
            held = sum(-sum(e.pages) for e in holders if e.pages)
            if held > self.arena.num_pages - self.arena.num_free:
                raise IndexInvariantError("arena: more pages held than allocated")
        else:
            used: dict[int, bytes] = {}
            for e in holders:
                for p in e.pages or ():
                    if p in used:
                        raise IndexInvariantError(f"page {p} is held by two entries")
                    used[p] = e.key
            if len(used) > self.arena.num_pages - self.arena.num_free:
                raise IndexInvariantError("arena: more pages held than allocated")
        unwritten = set(map(id, behind))
        for e in self.index.entries.values():
            if e.is_leaf and e not in self.delete_queue:
                raise IndexInvariantError(f"entry {e.key.hex()}: a leaf missing from the deletion queue")
            if e.pins < 0:
                raise IndexInvariantError(f"entry {e.key.hex()}: negative pins")
            if id(e) in unwritten:
                if e.on_disk or e.pages is None and not e.record or e in self.ram_queue:
                    raise IndexInvariantError(f"entry {e.key.hex()}: not yet written to LMDB, but not only in RAM "
                                              "(or demotable)")
                continue
            if self._disk.enabled and e.pages is not None and e not in self.ram_queue:
                raise IndexInvariantError(f"entry {e.key.hex()}: in RAM but missing from the RAM queue")
            if self._disk.enabled and not e.on_disk:
                raise IndexInvariantError(f"entry {e.key.hex()}: committed but neither written to LMDB nor "
                                          "behind the write-behind")


__all__ = ["Space"]
