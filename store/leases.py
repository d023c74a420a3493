"""Time-limited leases: what a lookup promised stays readable until then.

A lease pins entries (``Entry.pins``); pinned entries are never evicted or
overwritten. Leases expire by time and are only ever created by a lookup and
ended by release or expiry — a later lookup of the same prefix makes a new
lease and never extends an old one. Lease ids are 16 random bytes, so one
client cannot release another's lease by guessing.

A lease may also own a resource that must end with it (``on_end``: the NIXL
path's LMDB read transaction, store/nixl_target.py); it is called exactly
once, on release or expiry, whichever comes first.

Each lease belongs to a tenant (``owner``), and a tenant holds at most
``max_per_owner`` at once: a tenant that looks up without releasing ends its
own oldest leases early, and can never make the store hold an unbounded
number of them (DESIGN §11: every request is bounded, and so is what many
requests leave behind).
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable
from dataclasses import dataclass

from .index import Entry


@dataclass(slots=True)
class _Lease:
    expires_s: float
    entries: list[Entry]
    on_end: Callable[[], None] | None
    owner: str


class Leases:
    def __init__(self, unpin: Callable[[Entry], None], max_per_owner: int = 1 << 30) -> None:
        self._unpin = unpin
        self.max_per_owner = max_per_owner
        self._leases: dict[bytes, _Lease] = {}
        self._expiry: list[tuple[float, bytes]] = []
        self._by_owner: dict[str, dict[bytes, None]] = {}  # insertion order: oldest first

    def __len__(self) -> int:
        return len(self._leases)

    def held_by(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def grant(self, entries: list[Entry], now: float, ttl_s: float,
              on_end: Callable[[], None] | None = None, owner: str = "") -> bytes:
        lease_id = os.urandom(16)
        for e in entries:
            e.pins += 1
        expires = now + ttl_s
        self._leases[lease_id] = _Lease(expires, entries, on_end, owner)
        heapq.heappush(self._expiry, (expires, lease_id))
        mine = self._by_owner.setdefault(owner, {})
        mine[lease_id] = None
        while len(mine) > self.max_per_owner:
            self.release(next(iter(mine)))
        return lease_id

    def release(self, lease_id: bytes) -> bool:
        held = self._leases.pop(lease_id, None)
        if held is None:
            return False
        mine = self._by_owner.get(held.owner)
        if mine is not None:
            mine.pop(lease_id, None)
            if not mine:
                del self._by_owner[held.owner]
        try:
            for e in held.entries:
                self._unpin(e)
        finally:
            if held.on_end is not None:
                held.on_end()
        return True

    def expire(self, now: float) -> int:
        n = 0
        while self._expiry and self._expiry[0][0] <= now:
            _, lease_id = heapq.heappop(self._expiry)
            n += self.release(lease_id)
        return n

    def holds(self, lease_id: bytes) -> bool:
        return lease_id in self._leases

    def extend(self, lease_id: bytes, entries: list[Entry]) -> bool:
        """Pin more entries under a lease already granted, until it ends (same expiry). The
        lease's owner only: a lookup that also hands out where its payloads lie (NIXL). False
        when the lease is gone."""
        held = self._leases.get(lease_id)
        if held is None:
            return False
        for e in entries:
            e.pins += 1
        held.entries.extend(entries)
        return True
