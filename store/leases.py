"""Time-limited leases: what a lookup promised stays readable until then.

A lease pins entries (``Entry.pins``); pinned entries are never evicted or
overwritten. Leases expire by time and are only ever created by a lookup and
ended by release or expiry — a later lookup of the same prefix makes a new
lease and never extends an old one. Lease ids are 16 random bytes, so one
client cannot release another's lease by guessing.

A lease may also own a resource that must end with it (``on_end``: the NIXL
path's LMDB read transaction, store/nixl_target.py); it is called exactly
once, on release or expiry, whichever comes first.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Callable

from .index import Entry


class Leases:
    def __init__(self, unpin: Callable[[Entry], None]) -> None:
        self._unpin = unpin
        self._leases: dict[bytes, tuple[float, list[Entry], Callable[[], None] | None]] = {}
        self._expiry: list[tuple[float, bytes]] = []

    def __len__(self) -> int:
        return len(self._leases)

    def grant(self, entries: list[Entry], now: float, ttl_s: float,
              on_end: Callable[[], None] | None = None) -> bytes:
        lease_id = os.urandom(16)
        for e in entries:
            e.pins += 1
        expires = now + ttl_s
        self._leases[lease_id] = (expires, entries, on_end)
        heapq.heappush(self._expiry, (expires, lease_id))
        return lease_id

    def release(self, lease_id: bytes) -> bool:
        held = self._leases.pop(lease_id, None)
        if held is None:
            return False
        try:
            for e in held[1]:
                self._unpin(e)
        finally:
            if held[2] is not None:
                held[2]()
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
        held[1].extend(entries)
        return True
