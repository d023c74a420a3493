"""Saves that send no offer where the store can decide each item from the put itself.

An offer answers want / have / rejected per item and moves no bytes. A NIXL reserve answers the
same per item and reserves pages only for what it takes, so over NIXL a save that offers first
spends a round trip of its four on nothing; and a small save (``small_save_bytes``) costs less as
one HTTP put, what the store holds traveling for nothing (client/node.py ``NodeClient.save``).
These tests pin what the offer used to guarantee: over NIXL items the store holds are not written
again; a quota the batch would exceed still stores the part that fits; a larger HTTP save, whose
put carries every payload, still offers first.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.node import NodeClient
from prefixstore.protocol.errors import Reason
from prefixstore.store.index import entry_charge

from ..factories import kv_payload
from ..security.helpers import TOKENS, write_tenants
from .conftest import NEEDS_NIXL, Start
from .helpers import BLOCK_TOKENS, block_reads, namespace, read, tokens

pytestmark = NEEDS_NIXL


def record_calls(client: PrefixClient) -> list[str]:
    """The store paths ``client`` calls, in order (the node client's observers seam)."""
    node = client.impl
    assert isinstance(node, NodeClient)
    seen: list[str] = []

    async def observe(path: str, header: dict[str, object], answer: dict[str, object]) -> None:
        seen.append(path)

    node.observers.append(observe)
    return seen


async def test_a_nixl_save_reserves_without_an_offer_and_skips_what_the_store_has(start: Start) -> None:
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(7, 6)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", small_save_bytes=0)) as c:
        await c.prepare()
        calls = record_calls(c)
        first = await c.save(c.prompt(toks[: 4 * BLOCK_TOKENS]), 4 * BLOCK_TOKENS,
                             lambda a, b: kv_payload(ns, toks, a, b))
        assert (first.stored, first.already, first.rejected, first.dropped) == (4, 0, 0, 0)
        assert first.stored_bytes == 4 * ns.block_bytes
        assert "/v1/offer" not in calls and calls.count("/v1/nixl/reserve") == 1
        assert c.path_bytes["nixl"] == 4 * ns.block_bytes
        # The chain grows by two blocks: the four the store holds are answered "have" by the
        # reserve and never written; only the new two move.
        calls.clear()
        second = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
        assert (second.stored, second.already, second.rejected, second.dropped) == (2, 4, 0, 0)
        assert second.stored_bytes == 2 * ns.block_bytes and len(second.results) == 2
        assert c.path_bytes["nixl"] == 6 * ns.block_bytes
        assert calls == ["/v1/nixl/reserve", "/v1/nixl/commit"]
        items, expected = block_reads(c, toks)
        got, outs = await read(c, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 6 and [o.tobytes() for o in outs] == expected
        assert (await c.lookup(toks)).kv_tokens == len(toks)
        assert c.failures == {} and not store.pending


@pytest.mark.parametrize("small_save_bytes", [0, 1 << 20], ids=["nixl-reserve", "small-http-put"])
async def test_a_save_over_the_tenants_quota_is_offered_and_stores_what_fits(
        start: Start, tmp_path: Path, small_save_bytes: int) -> None:
    """The reserve, or the small save's put, is refused whole when it would take the tenant over
    its quota; the save then offers the batch, as before, and the blocks that fit are stored (not
    one dropped save)."""
    ns = namespace(tenant="alpha")
    block = entry_charge(ns.block_bytes, b"\0" * 4 * ns.block_tokens, b"")
    tenants = write_tenants(tmp_path / "tenants.toml", {"alpha": 3 * block + 4096})  # 3 blocks and the namespace
    url, store = await start(ram_bytes=1 << 20, tenants_file=str(tenants))
    toks = tokens(8, 5)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", token=TOKENS["alpha"],
                                             small_save_bytes=small_save_bytes)) as c:
        await c.prepare()
        calls = record_calls(c)
        saved = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
        # The put was refused whole (a 413: no answer the observers see), then the batch offered.
        assert [p for p in calls if p != "/v1/namespaces"][:3] == ["/v1/offer", "/v1/nixl/reserve", "/v1/nixl/commit"]
        assert (saved.stored, saved.rejected, saved.dropped) == (3, 2, 0)
        assert (await c.lookup(toks)).kv_tokens == 3 * BLOCK_TOKENS
        assert c.path_bytes["nixl"] == 3 * ns.block_bytes
        assert c.failures == {}  # not a failure: the store answered each item, as an offer always has
    assert store.tenant_bytes["alpha"] <= 3 * block + 4096


async def test_a_larger_http_save_still_offers_first(start: Start) -> None:
    """Over HTTP a put carries every payload before the store decides: above ``small_save_bytes``
    the offer stays, and the blocks the store holds are neither asked for nor sent."""
    url, _ = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(9, 4)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="http", small_save_bytes=ns.block_bytes)) as c:
        asked: list[tuple[int, int]] = []

        def payload(a: int, b: int) -> bytes:
            asked.append((a, b))
            return kv_payload(ns, toks, a, b)
        assert (await c.save(c.prompt(toks[: 2 * BLOCK_TOKENS]), 2 * BLOCK_TOKENS, payload)).stored == 2
        calls = record_calls(c)
        asked.clear()
        second = await c.save(c.prompt(toks), len(toks), payload)
        assert (second.stored, second.already) == (2, 2)
        assert calls[0] == "/v1/offer"
        assert asked == [(2 * BLOCK_TOKENS, 3 * BLOCK_TOKENS), (3 * BLOCK_TOKENS, 4 * BLOCK_TOKENS)]
        assert c.path_bytes["http"] == 4 * ns.block_bytes and c.path_bytes["nixl"] == 0
        assert Reason.QUOTA not in {r.reason for _, r in second.results}


async def test_a_small_save_goes_as_one_http_put_even_beside_nixl(start: Start) -> None:
    """At most ``small_save_bytes``: one /v1/put, no offer, no NIXL round trips. The store still
    decides each item: the blocks it holds are answered "have" (their bytes traveled, nothing is
    stored twice), the new ones stored, and every byte reads back right."""
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(10, 6)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", small_save_bytes=6 * ns.block_bytes)) as c:
        await c.prepare()
        assert c.data_path == "nixl"
        assert (await c.save(c.prompt(toks[: 4 * BLOCK_TOKENS]), 4 * BLOCK_TOKENS,
                             lambda a, b: kv_payload(ns, toks, a, b))).stored == 4
        calls = record_calls(c)
        entries = len(store.index.entries)
        second = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
        assert calls == ["/v1/put"]
        assert (second.stored, second.already, second.rejected, second.dropped) == (2, 4, 0, 0)
        assert second.stored_bytes == 2 * ns.block_bytes and len(second.results) == 6  # all six were sent
        assert len(store.index.entries) == entries + 2
        assert c.path_bytes["nixl"] == 0 and c.path_bytes["http"] == 6 * ns.block_bytes
        items, expected = block_reads(c, toks)
        got, outs = await read(c, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 6 and [o.tobytes() for o in outs] == expected
        # One byte over: NIXL, decided by its reserve (no offer), only the new block written.
        more = tokens(11, 7)
        more[: 6 * BLOCK_TOKENS] = toks
        calls.clear()
        before = c.path_bytes["nixl"]  # the reads above went over NIXL
        third = await c.save(c.prompt(more), len(more), lambda a, b: kv_payload(ns, more, a, b))
        assert (third.stored, third.already) == (1, 6)
        assert calls == ["/v1/nixl/reserve", "/v1/nixl/commit"] and c.path_bytes["nixl"] - before == ns.block_bytes
