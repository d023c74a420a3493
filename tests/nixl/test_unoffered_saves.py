"""Saves that send no offer where the store can decide each item from the put itself.

An offer answers want / have / rejected per item and moves no bytes. A NIXL reserve answers the
same per item and reserves pages only for what it takes, so over NIXL a save that offers first
spends a round trip of its four on nothing; and a small save (``small_save_bytes``) costs less as
one HTTP put, what the store holds traveling for nothing (client/node.py ``NodeClient.save``).
These tests pin what the offer used to guarantee: over NIXL items the store holds are not written
again; a quota the batch would exceed still stores the part that fits, and admission judges each
item once; a larger HTTP save, whose put carries every payload, still offers first; and with the
client's default (0) every save still offers first.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from aiohttp.test_utils import TestServer

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.node import NodeClient
from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.keys import Kind
from prefixstore.store import STORE, StoreConfig, create_app
from prefixstore.store.http import CLUSTER_SIZE
from prefixstore.store.index import entry_charge

from ..factories import kv_payload, state_payload
from ..security.helpers import TOKENS, write_tenants
from .conftest import NEEDS_NIXL, Clock, Start
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
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", small_save_bytes=1)) as c:  # every batch larger
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


@pytest.mark.parametrize("small_save_bytes", [1, 1 << 20], ids=["nixl-reserve", "small-http-put"])
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
        made: list[tuple[int, int]] = []

        def payload(a: int, b: int) -> bytes:
            made.append((a, b))
            return kv_payload(ns, toks, a, b)

        saved = await c.save(c.prompt(toks), len(toks), payload)
        # The put was refused whole (a 413: no answer the observers see), then the batch offered.
        assert [p for p in calls if p != "/v1/namespaces"][:3] == ["/v1/offer", "/v1/nixl/reserve", "/v1/nixl/commit"]
        # Each payload was made once: the put after the offer sent those the refused put had made.
        assert sorted(made) == [(i * BLOCK_TOKENS, (i + 1) * BLOCK_TOKENS) for i in range(5)]
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


async def test_with_the_clients_default_every_save_offers_first(start: Start) -> None:
    """``small_save_bytes`` 0 (the client's default): over NIXL too the save offers first, and
    ``kv_payload`` is called only for what the store wants."""
    url, _ = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(12, 4)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as c:
        await c.prepare()
        asked: list[tuple[int, int]] = []

        def payload(a: int, b: int) -> bytes:
            asked.append((a, b))
            return kv_payload(ns, toks, a, b)
        assert (await c.save(c.prompt(toks[: 3 * BLOCK_TOKENS]), 3 * BLOCK_TOKENS, payload)).stored == 3
        calls = record_calls(c)
        asked.clear()
        again = await c.save(c.prompt(toks), len(toks), payload)
        assert (again.stored, again.already) == (1, 3)
        assert calls == ["/v1/offer", "/v1/nixl/reserve", "/v1/nixl/commit"]
        assert asked == [(3 * BLOCK_TOKENS, 4 * BLOCK_TOKENS)]


async def test_a_single_node_client_cannot_save_onto_one_node_of_a_cluster_over_nixl() -> None:
    """A cluster node holds only its branches: an item without one (a single-node client's) is
    refused at the NIXL reserve as at an offer or a put (409), so a save with no offer is dropped
    and counted, never stored where no lookup finds it."""
    config = StoreConfig(port=0, data_dir="none", ram_bytes=1 << 20, page_bytes=4096, nixl="on",
                         peers="http://127.0.0.1:9")
    app = create_app(config, Clock())
    app[CLUSTER_SIZE] = lambda: 2  # as a node of a two-member cluster answers
    server = TestServer(app, host="127.0.0.1")
    await server.start_server()
    try:
        store = app[STORE]
        ns = namespace()
        toks = tokens(13, 4)
        url = str(server.make_url("")).rstrip("/")
        async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", small_save_bytes=1)) as c:
            await c.prepare()
            saved = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
            assert saved.stored == 0 and saved.dropped == 4
            assert c.failures["put"] >= 1
        assert len(store.index.entries) == 0 and not store.pending
    finally:
        await server.close()


@pytest.mark.parametrize("small_save_bytes", [1, 1 << 20], ids=["nixl-reserve", "small-http-put"])
async def test_a_refused_put_then_its_offer_judge_each_snapshot_once(
        start: Start, tmp_path: Path, small_save_bytes: int) -> None:
    """Second-hit admission takes a snapshot on its second sighting. A put refused whole over the
    quota has asked admission already; the offer that follows must not ask again, or a snapshot
    would be taken on its first save. Whatever the road, the save stores what an offered save
    stores at the same quota."""
    ns = namespace(tenant="alpha")
    block = entry_charge(ns.block_bytes, b"\0" * 4 * ns.block_tokens, b"")
    toks = tokens(31, 5)
    snaps = {k * BLOCK_TOKENS: state_payload(ns, toks, k * BLOCK_TOKENS) for k in (1, 2)}

    async def save_at(small: int, quota: int) -> tuple[int, int]:
        tenants = write_tenants(tmp_path / f"tenants-{small}-{quota}.toml", {"alpha": quota})
        url, _ = await start(ram_bytes=1 << 20, tenants_file=str(tenants), state_admission="second-hit")
        async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", token=TOKENS["alpha"],
                                                 small_save_bytes=small)) as c:
            await c.prepare()
            r = await c.save(c.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b), snaps)
            assert r.dropped == 0
            return r.stored, sum(1 for kind, x in r.results if kind is Kind.STATE and x.status is ItemStatus.OK)

    for quota in (4 * block + 1024, 4 * block + 3072):  # four blocks and the namespace fit, not five
        offered = await save_at(0, quota)
        assert offered[1] == 0  # first sighting: no snapshot taken
        assert await save_at(small_save_bytes, quota) == offered
