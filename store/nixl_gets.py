"""What a ``/v1/nixl/get`` hands out: per payload, NIXL descriptors or "read it over HTTP", under one lease.

The route (store/nixl_target.py ``nixl_get``) parses and frames; :meth:`NixlGets.plan` decides and
returns a typed :class:`NixlGetPlan`:

1. ``prepare_get`` (store/reads.py) pins every entry asked for. Its disk-only slots are first
   offered to :meth:`NixlGets._map_disk`: with map READs on (the target registered LMDB's map),
   one LMDB read transaction (``LmdbTier.pin``) pins their values in place, each value's xxh3
   verified once; what that transaction cannot take is promoted into the arena as before.
2. :func:`choose` picks each slot's way (a pure function of the slot, what its owner's leases
   may still pin, and whether the map pin still holds), in request order:

   ====== ==========================================================================
   MISS   not stored, corrupt, or refused: its status, nothing else
   HTTP   over the owner's leased-bytes room; in LMDB's map but the map moved since
          the pin; held in a read buffer (RAM was all pinned); or no arena pages
   MAP    READ straight from LMDB's map (the pinned transaction's address)
   ARENA  READ from the arena's pages (runs of consecutive pages)
   ====== ==========================================================================

3. One lease pins what MAP and ARENA slots point into; where a MAP slot is offered, the lease
   also owns the read transaction (``lease_pin``: it ends with the lease, or when the map grows).
   A pin no lease took ends before the answer; ``prepare_get``'s own pins drop in ``finish_get``.

Rejected: deciding in the route's closure (as before), where the choice could be tested only
through a NIXL agent and a real transfer; :func:`choose` is now asserted alone.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixstore.protocol.errors import ItemStatus
from prefixstore.protocol.nixl_wire import RUN, NixlItem
from prefixstore.protocol.wire import GetItem
from .index import Entry
from .leases import Leases
from .lmdb_tier import LmdbTier, MapPin, ReadOutcome
from .metrics import StoreMetrics
from .reads import GetPlan, GetSlot, MapDisk


class Route(enum.Enum):
    """How one payload of a NIXL get is offered (module docstring)."""

    MISS = "miss"
    HTTP = "http"
    MAP = "map"
    ARENA = "arena"


def choose(slot: GetSlot, room_left: int | None, map_live: bool) -> Route:
    """One prepared slot's way. ``room_left``: bytes the owner's lease may still pin (None: no
    bound); ``map_live``: the request's LMDB map pin exists and has not ended (the map did not
    move since)."""
    e = slot.entry
    if slot.status is not ItemStatus.OK or e is None:
        return Route.MISS
    if room_left is not None and e.size > room_left:
        return Route.HTTP  # the lease would pin past the owner's bound (store/leases.py)
    if slot.address:
        return Route.MAP if map_live else Route.HTTP
    if slot.buffer is not None or e.pages is None:
        return Route.HTTP
    return Route.ARENA


@dataclass(frozen=True, slots=True, kw_only=True)
class NixlGetPlan:
    """A NIXL get's answer, decided: one item per request item, the lease over what is offered."""

    items: tuple[NixlItem, ...]
    routes: tuple[Route, ...]
    lease: bytes | None
    lease_ttl_s: float  # 0 without a lease
    offered_bytes: int  # payload bytes offered for READs (counted as out/nixl transfer bytes)


class GetReads(Protocol):
    """The read path as the facade offers it (store/core.py ``Store``)."""

    async def prepare_get(self, ns_id: bytes, items: Sequence[GetItem], map_disk: MapDisk | None = None,
                          field: str = "items") -> GetPlan: ...

    def finish_get(self, plan: GetPlan) -> None: ...


class MapTarget(Protocol):
    """What the plan needs of the NIXL target (store/nixl_target.py ``NixlTarget``)."""

    @property
    def map_reads(self) -> bool: ...

    def descriptors(self, pages: list[int], offset: int, length: int) -> bytes: ...

    def lease_pin(self, pin: MapPin, entries: list[Entry], owner: str) -> bytes: ...

    def expect_traffic(self, token: bytes) -> None: ...


class NixlGets:
    """Plans NIXL gets (module docstring). Receives the parts it uses; reaches into no other."""

    def __init__(self, target: MapTarget, reads: GetReads, leases: Leases, tier: LmdbTier | None,
                 metrics: StoreMetrics, clock: Callable[[], float], lease_ttl_s: float) -> None:
        self._target = target
        self._reads = reads
        self._leases = leases
        self._tier = tier
        self._metrics = metrics
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s

    async def plan(self, ns_id: bytes, owner: str, items: Sequence[GetItem], field: str = "items") -> NixlGetPlan:
        """Pin, choose each payload's way and lease what is offered (module docstring)."""
        pins: list[MapPin] = []  # the one read transaction of this request's LMDB-resident payloads
        out: list[NixlItem] = []
        routes: list[Route] = []
        lease: bytes | None = None
        offered = 0
        try:
            got = await self._reads.prepare_get(ns_id, items, lambda slots: self._map_disk(slots, pins), field)
            try:
                pin = pins[0] if pins else None
                room = self._leases.room(owner)
                leased: list[Entry] = []
                pinned = 0
                for slot in got.slots:
                    route = choose(slot, None if room is None else room - pinned, pin is not None and not pin.ended)
                    routes.append(route)
                    e = slot.entry
                    if route is Route.MISS:
                        out.append(NixlItem(slot.status))
                        continue
                    if route is Route.HTTP:
                        out.append(NixlItem(ItemStatus.HTTP, slot.length, slot.checksum))
                        continue
                    assert e is not None
                    if route is Route.MAP:
                        runs = RUN.pack(slot.address, slot.length)
                    else:
                        assert e.pages is not None
                        # A head range is several runs of the value: one descriptor list per run.
                        runs = b"".join(self._target.descriptors(e.pages, lo, n) for lo, n in slot.ranges())
                    out.append(NixlItem(ItemStatus.OK, slot.length, slot.checksum, runs))
                    leased.append(e)
                    pinned += e.size
                    offered += slot.length
                # The lease pins what the descriptors point into (and holds the read transaction of
                # those in LMDB's map); prepare_get's own pins drop in finish_get.
                if pin is not None and Route.MAP in routes:
                    lease = self._target.lease_pin(pin, leased, owner)
                    pins.clear()  # the lease ends it now
                elif leased:
                    lease = self._leases.grant(leased, self._clock(), self._lease_ttl_s, owner=owner)
            finally:
                self._reads.finish_get(got)
        finally:
            for unused in pins:  # not handed to a lease (nothing in the map was offered, or an error)
                unused.end()
        if lease is not None:
            self._target.expect_traffic(lease)
            self._metrics.transfer_bytes.labels("out", "nixl").inc(offered)
        return NixlGetPlan(items=tuple(out), routes=tuple(routes), lease=lease,
                           lease_ttl_s=self._lease_ttl_s if lease is not None else 0.0, offered_bytes=offered)

    async def _map_disk(self, slots: list[GetSlot], pins: list[MapPin]) -> list[str | None]:
        """prepare_get's ``map_disk``: offer LMDB-resident payloads straight from LMDB's map, verified,
        in one read transaction (appended to ``pins``); None for a slot to promote as usual."""
        tier = self._tier
        assert tier is not None  # prepare_get offers disk-only slots only where there is a tier
        promoted = self._metrics.nixl_disk_reads.labels("promoted")
        if not self._target.map_reads:  # nixl_map_txns = 0, or the map could not be registered
            promoted.inc(len(slots))
            return []
        # A head range is several runs of the value: promoted into RAM and described page by page,
        # not pinned in the map (one pin is one address and one checksum).
        mappable = [s for s in slots if s.runs is None and s.entry is not None]
        pin, found = await tier.pin([(s.entry.key, s.entry.size, s.entry.checksum, s.offset, s.length)
                                     for s in mappable if s.entry is not None]) if mappable else (None, [])
        if pin is not None:
            pins.append(pin)
        if not found:  # refused before looking (cap reached, map growing): all promoted
            promoted.inc(len(slots))
            return []
        outcome_of: dict[int, str | None] = {}
        for slot, f in zip(mappable, found):
            if f.outcome == ReadOutcome.OK and pin is not None:
                slot.address, slot.checksum = f.address, f.checksum
            outcome_of[id(slot)] = f.outcome if pin is not None or f.outcome != ReadOutcome.OK else None
        outcomes = [outcome_of.get(id(slot)) for slot in slots]
        self._metrics.nixl_disk_reads.labels("map").inc(sum(o == ReadOutcome.OK for o in outcomes))
        promoted.inc(sum(o is None for o in outcomes))
        return outcomes


__all__ = ["GetReads", "MapTarget", "NixlGetPlan", "NixlGets", "Route", "choose"]
