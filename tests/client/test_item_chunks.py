"""client/node.py ``item_chunks``: the calls an offer or a put is split into. Every item once, in order,
at most ``max_items`` a call, and a call never ends between an item and the snapshots right after it
when they fit in one (a store decides a snapshot against its container in the same offer)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from prefixstore.client.node import item_chunks
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.wire import ItemSpec


def spec(kind: Kind) -> ItemSpec:
    return ItemSpec(kind=kind, hash=b"\x01" * 16, size=0)


@given(kinds=st.lists(st.sampled_from([Kind.BLOCK, Kind.STATE]), max_size=60), max_items=st.integers(1, 9))
def test_calls_cover_every_item_in_order_and_keep_snapshots_with_their_block(kinds: list[Kind], max_items: int) -> None:
    specs = [spec(k) for k in kinds]
    calls = list(item_chunks(specs, max_items))
    assert [i for s, e in calls for i in range(s, e)] == list(range(len(specs)))
    assert all(0 < e - s <= max_items for s, e in calls)
    for s, e in calls[:-1]:
        if kinds[e] is Kind.STATE:  # a call ended before a snapshot: only where its group could not fit
            first = e
            while first > 0 and kinds[first - 1] is Kind.STATE:
                first -= 1
            group_start = max(first - 1, 0)  # the block the snapshots follow
            end = e
            while end < len(kinds) and kinds[end] is Kind.STATE:
                end += 1
            assert end - group_start > max_items or group_start <= s, (kinds, max_items, calls)


def test_a_call_ends_before_the_block_whose_snapshots_would_not_fit() -> None:
    kinds = [Kind.BLOCK, Kind.BLOCK, Kind.BLOCK, Kind.STATE, Kind.BLOCK]
    assert list(item_chunks([spec(k) for k in kinds], 3)) == [(0, 2), (2, 5)]
