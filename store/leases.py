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

Pins are a tenant's resource in bytes too: a pinned entry cannot be demoted or
deleted, so sixteen leases over sixteen 1 MiB entries pinned a whole 16 MiB
arena, and another tenant's 1 MiB save was refused ("RAM arena full of pinned
entries") while the first held half its quota. Each lease is charged the
payload bytes of its entries (whatever their tier: a disk-only entry a get
promotes stays pinned in RAM), and a tenant's leases pin at most
``max_bytes_per_owner`` (``max_leased_share`` of the arena): a grant ends the
tenant's oldest leases until its own fits, and :meth:`extend` (NIXL
placements, which hand out where pages lie) pins only what fits. One lease
alone may be larger (a lookup's or probe's few entries are never refused: the
bound is then that lease), so what a tenant pins is at most the bound or its
newest lease. Counting an entry once per lease that holds it is deliberate:
it is what the tenant asked to hold, and engines release what they read.
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
    nbytes: int = 0  # payload bytes of its entries, charged to the owner


class Leases:
    def __init__(self, unpin: Callable[[Entry], None], max_per_owner: int = 1 << 30,
                 max_bytes_per_owner: int | None = None) -> None:
        """``max_bytes_per_owner``: the bytes one owner's leases may pin (None: unbounded)."""
        self._unpin = unpin
        self.max_per_owner = max_per_owner
        self.max_bytes_per_owner = max_bytes_per_owner
        self._leases: dict[bytes, _Lease] = {}
        self._expiry: list[tuple[float, bytes]] = []
        self._by_owner: dict[str, dict[bytes, None]] = {}  # insertion order: oldest first
        self._bytes: dict[str, int] = {}  # payload bytes pinned by each owner's leases

    def __len__(self) -> int:
        return len(self._leases)

    def held_by(self, owner: str) -> int:
        return len(self._by_owner.get(owner, ()))

    def bytes_held_by(self, owner: str) -> int:
        """Payload bytes the owner's leases pin (an entry counted once per lease holding it)."""
        return self._bytes.get(owner, 0)

    @property
    def bytes_by_owner(self) -> dict[str, int]:
        return {owner: n for owner, n in self._bytes.items() if n}

    def room(self, owner: str) -> int | None:
        """Most bytes a new lease of ``owner`` may pin and stay within the bound (granting it ends
        the owner's older leases as needed); None: unbounded."""
        return self.max_bytes_per_owner

    def _end_oldest(self, owner: str, keep: bytes) -> bool:
        """End the owner's oldest lease other than ``keep``; False when it has none."""
        for lease_id in self._by_owner.get(owner, ()):
            if lease_id != keep:
                self.release(lease_id)
                return True
        return False

    def _fits(self, owner: str, more: int) -> bool:
        bound = self.max_bytes_per_owner
        return bound is None or self._bytes.get(owner, 0) + more <= bound

    def grant(self, entries: list[Entry], now: float, ttl_s: float,
              on_end: Callable[[], None] | None = None, owner: str = "") -> bytes:
        lease_id = os.urandom(16)
        nbytes = 0
        for e in entries:
            e.pins += 1
            nbytes += e.size
        expires = now + ttl_s
        self._leases[lease_id] = _Lease(expires, entries, on_end, owner, nbytes)
        heapq.heappush(self._expiry, (expires, lease_id))
        self._bytes[owner] = self._bytes.get(owner, 0) + nbytes
        mine = self._by_owner.setdefault(owner, {})
        mine[lease_id] = None
        while len(mine) > self.max_per_owner:
            self.release(next(iter(mine)))
        while not self._fits(owner, 0) and self._end_oldest(owner, lease_id):
            pass
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
        left = self._bytes.get(held.owner, 0) - held.nbytes
        if left:
            self._bytes[held.owner] = left
        else:
            self._bytes.pop(held.owner, None)
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

    def extend(self, lease_id: bytes, entries: list[Entry]) -> list[Entry]:
        """Pin more entries under a lease already granted, until it ends (same expiry): a lookup
        that also hands out where its payloads lie (NIXL). In order, as many as the owner's bound
        allows (its older leases ended first); returns those pinned (none when the lease is gone).
        What is not returned must not be handed out: nothing keeps its pages."""
        held = self._leases.get(lease_id)
        if held is None:
            return []
        pinned: list[Entry] = []
        for e in entries:
            while not self._fits(held.owner, e.size) and self._end_oldest(held.owner, lease_id):
                pass
            if not self._fits(held.owner, e.size):
                break
            e.pins += 1
            held.entries.append(e)
            held.nbytes += e.size
            self._bytes[held.owner] = self._bytes.get(held.owner, 0) + e.size
            pinned.append(e)
        return pinned
