"""The NIXL get planner (store/nixl_gets.py): which payload goes which way, and what one lease pins.

No NIXL agent: the planner runs on a real store core with a stand-in for the target (descriptors
over the arena's pages, no map registration), so the decision is checked alone; the transfers
themselves are tests/nixl's."""

from __future__ import annotations

import mmap

import pytest

from prefixstore.client.prompt import Prompt
from prefixstore.protocol.errors import ItemStatus
from prefixstore.protocol.wire import GetItem
from prefixstore.store import StoreConfig
from prefixstore.store.index import Entry
from prefixstore.store.leases import Leases
from prefixstore.store.lmdb_tier import MapPin
from prefixstore.store.nixl_gets import NixlGets, Route, choose
from prefixstore.store.nixl_target import run_descriptors
from prefixstore.store.reads import GetSlot

from ..factories import make_namespace
from .harness import CoreHarness

PAGE = 256


class StandIn:
    """The target's part the planner uses, without an agent (map READs off)."""

    map_reads = False

    def __init__(self) -> None:
        self.traffic: list[bytes] = []

    def descriptors(self, pages: list[int], offset: int, length: int) -> bytes:
        return run_descriptors(0, PAGE, pages, offset, length)

    def lease_pin(self, pin: MapPin, entries: list[Entry], owner: str) -> bytes:
        raise AssertionError("no map READs here")

    def expect_traffic(self, token: bytes) -> None:
        self.traffic.append(token)


def entry(size: int, pages: list[int] | None = None) -> Entry:
    e = Entry.__new__(Entry)
    e.size, e.pages = size, pages
    return e


@pytest.mark.parametrize(("slot", "room", "live", "route"), [
    (GetSlot(ItemStatus.MISSING), None, True, Route.MISS),
    (GetSlot(ItemStatus.OK), None, True, Route.MISS),  # no entry: nothing to point at
    (GetSlot(ItemStatus.OK, entry(512, [0, 1])), None, False, Route.ARENA),
    (GetSlot(ItemStatus.OK, entry(512, [0, 1])), 512, False, Route.ARENA),  # exactly the room left
    (GetSlot(ItemStatus.OK, entry(512, [0, 1])), 511, False, Route.HTTP),  # a byte over it
    (GetSlot(ItemStatus.OK, entry(512, [0, 1]), address=4096), None, True, Route.MAP),
    (GetSlot(ItemStatus.OK, entry(512, [0, 1]), address=4096), None, False, Route.HTTP),  # the map moved
    (GetSlot(ItemStatus.OK, entry(512, [0, 1]), address=4096), 100, True, Route.HTTP),  # room first
    (GetSlot(ItemStatus.OK, entry(512, None)), None, True, Route.HTTP),  # disk-only, not promoted
    (GetSlot(ItemStatus.OK, entry(512, [0, 1]), buffer=mmap.mmap(-1, 512)), None, True, Route.HTTP),
])
def test_each_slot_takes_its_way(slot: GetSlot, room: int | None, live: bool, route: Route) -> None:
    assert choose(slot, room, live) is route


@pytest.mark.parametrize(("bound_blocks", "arena"), [(None, 3), (2, 2), (1, 1)])
def test_a_plan_leases_what_fits_its_owners_room_and_sends_the_rest_over_http(bound_blocks: int | None,
                                                                              arena: int) -> None:
    ns = make_namespace(block_tokens=4)
    h = CoreHarness(StoreConfig(port=0, data_dir="none", ram_bytes=64 * PAGE, page_bytes=PAGE), ns)
    try:
        toks = list(range(1, 13))  # 3 blocks, 2 pages each
        h.save(toks, 12)
        p = Prompt(ns, toks)
        size = h.store.index.get_block(ns.id, p.hashes[0]).size  # type: ignore[union-attr]
        bound = None if bound_blocks is None else bound_blocks * size
        leases = Leases(h.store.space.unpin, max_bytes_per_owner=bound)
        target = StandIn()
        gets = NixlGets(target, h.store, leases, None, h.store.metrics, lambda: h.now[0], 30.0)
        items = [GetItem(key=p.block_key(j)) for j in range(3)] + [GetItem(key=b"\x01" + bytes(16))]
        plan = h.run(gets.plan(ns.id, "t", items))
        assert plan.routes == (Route.ARENA,) * arena + (Route.HTTP,) * (3 - arena) + (Route.MISS,)
        assert [i.status for i in plan.items] == [ItemStatus.OK] * arena + [ItemStatus.HTTP] * (3 - arena) + \
            [ItemStatus.MISSING]
        assert plan.offered_bytes == arena * size and plan.lease is not None and plan.lease_ttl_s == 30.0
        assert leases.held_by("t") == 1 and target.traffic == [plan.lease]
        assert all(i.runs for i in plan.items[:arena]) and not any(i.runs for i in plan.items[arena:])
        pinned = [e for e in h.store.index.entries.values() if e.pins]
        assert len(pinned) == arena  # the lease's pins; prepare_get's own dropped in finish_get
        assert leases.release(plan.lease) and not any(e.pins for e in h.store.index.entries.values())
    finally:
        h.close()
