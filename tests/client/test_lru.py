"""BoundedLRU: the one bounded memory of the client (client/lru.py), and the save tally every client
counts with (client/results.py ``tally``)."""

from __future__ import annotations

import pytest

from prefixstore.client.lru import BoundedLRU
from prefixstore.client.results import tally
from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.wire import ItemResult


def test_the_oldest_write_goes_first_and_a_rewrite_makes_a_key_newest() -> None:
    evicted: list[tuple[str, int]] = []
    lru: BoundedLRU[str, int] = BoundedLRU(3, on_evict=lambda k, v: evicted.append((k, v)))
    for i, k in enumerate("abc"):
        lru.put(k, i)
    lru.put("a", 10)  # a is now the newest: b goes next
    assert lru.get("a") == 10  # a read does not refresh
    lru.put("d", 3)
    assert list(lru) == ["c", "a", "d"] and evicted == [("b", 1)]
    lru.put("e", 4)
    assert list(lru) == ["a", "d", "e"] and evicted == [("b", 1), ("c", 2)]
    assert len(lru) == 3 and "c" not in lru and lru.get("c", -1) == -1


def test_put_many_keeps_the_place_of_a_held_key_and_trims_to_capacity() -> None:
    lru: BoundedLRU[int, str] = BoundedLRU(4)
    lru.put_many([(1, "a"), (2, "b"), (3, "c")])
    lru.put_many([(1, "A"), (4, "d"), (5, "e")])  # 1 keeps its place (the oldest) and goes
    assert list(lru) == [2, 3, 4, 5] and lru.get(1) is None
    assert lru.pop_oldest() == (2, "b") and lru.pop(4) == "d" and lru.pop(4) is None
    assert list(lru) == [3, 5]


def test_capacity_zero_forgets_every_write_and_a_negative_one_is_refused() -> None:
    evicted: list[int] = []
    lru: BoundedLRU[int, int] = BoundedLRU(0, on_evict=lambda k, _: evicted.append(k))
    lru.put(1, 1)
    assert len(lru) == 0 and evicted == [1]
    with pytest.raises(ValueError, match="capacity"):
        BoundedLRU(-1)


def test_a_save_is_tallied_by_each_items_last_answer() -> None:
    ok, have = ItemResult(ItemStatus.OK), ItemResult(ItemStatus.HAVE)
    gone = ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)
    unanswered = ItemResult(ItemStatus.REJECTED, Reason.UNAVAILABLE)  # an offer no store answered
    refused = ItemResult(ItemStatus.REJECTED, Reason.QUOTA)
    r = tally([ok, have, gone, unanswered, refused, ok], [(Kind.BLOCK, ok), (Kind.STATE, ok)])
    assert (r.stored, r.already, r.dropped, r.rejected) == (2, 1, 2, 1)
    assert r.results == [(Kind.BLOCK, ok), (Kind.STATE, ok)]
