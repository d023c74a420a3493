"""Tenant isolation and bounds, tested as an attacker holding a valid tenant token would.

A namespace id is the hash of public fields (model, layout, tenant name), so tenant beta can
compute tenant alpha's hash chain for any prompt it guesses and replay it under beta's own
namespace. Every answer to such a replay must be the answer to a prompt alpha never stored:
word for word, with no lease, no NIXL placement and nothing pinned. And nothing a tenant sends
may make the store hold unbounded memory or stall others (issue: isolation against a tenant who
computes your hashes, and no request that can freeze a node).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.node import NodeClient
from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import Namespace
from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.probe import ProbeRequest
from prefixstore.protocol.wire import CONTENT_TYPE, encode_frame
from prefixstore.store import STORE, StoreConfig, StoreRunner, create_app

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload
from ..nixl.conftest import NEEDS_NIXL
from ..samples import sample
from .helpers import ADMIN_TOKEN, TOKENS, raw_post, write_tenants

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
NS_A, NS_B = make_namespace(tenant="alpha"), make_namespace(tenant="beta")
STORED = list(range(100, 100 + 4 * NS_A.block_tokens + 3))  # 4 blocks and a 3-token tail, saved by alpha
NEVER = [t + 1 for t in STORED]  # the same shape, never stored by anyone


async def start_tenanted(start_store: StartStore, tmp_path: Path, **knobs: object) -> RunningStore:
    values: dict[str, object] = dict(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                                     disk_bytes=64 << 20, tenants_file=str(write_tenants(tmp_path / "t.toml")),
                                     nixl="off")
    values.update(knobs)
    return await start_store(StoreConfig(**values))  # type: ignore[arg-type]


def client(running: RunningStore, tenant: str, ns: Namespace) -> PrefixClient:
    return running.client(ns, token=TOKENS[tenant])


async def alpha_saves(running: RunningStore) -> None:
    async with client(running, "alpha", NS_A) as a:
        res = await a.save(a.prompt(STORED), len(STORED), lambda s, e: kv_payload(NS_A, STORED, s, e),
                           snapshots={n: state_payload(NS_A, STORED, n) for n in (8, len(STORED))})
        assert res.stored == 7 and res.dropped == 0, res  # 4 blocks, a tail, two snapshots
        assert (await a.lookup(STORED, lease=False)).state_tokens == len(STORED)


async def register_beta(running: RunningStore) -> None:
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": NS_B.to_wire()}, TOKENS["beta"])
    assert answer.status == 200


def replay_lookup(tokens: list[int], **flags: object) -> dict[str, object]:
    """Beta's lookup of alpha's hash chain of ``tokens``, under beta's namespace."""
    p = Prompt(NS_A, tokens)
    return {"ns": NS_B.id, "hashes": b"".join(p.hashes), "tokens": p.packed, "lease": True, **flags}


def replay_probe(tokens: list[int]) -> dict[str, object]:
    """Beta's cluster probe of alpha's levels of ``tokens``, under beta's namespace."""
    p = Prompt(NS_A, tokens)
    return {"ns": NS_B.id, "start": 0, "parent": p.root, "hashes": b"".join(p.hashes), "tokens": p.packed,
            "lease": True}


def replay_offer(tokens: list[int]) -> dict[str, object]:
    """Beta offers blocks chained onto alpha's blocks (parent = alpha's h_j) and a snapshot in alpha's tail."""
    p = Prompt(NS_A, tokens)
    specs = [spec.to_wire() for spec, _, _ in p.kv_items(len(tokens))]
    specs.append(p.state_item(len(tokens), len(tokens)).to_wire())
    return {"ns": NS_B.id, "items": specs[1:]}  # not the first block: its parent is a root, beta's own


async def test_a_replayed_hash_chain_answers_exactly_like_a_prompt_never_stored(
        start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path)
    await alpha_saves(running)
    await register_beta(running)
    store = running.store
    leases_before, pins_before = len(store.leases), sum(e.pins for e in store.index.entries.values())
    for path, build in (("/v1/lookup", replay_lookup), ("/v1/probe", replay_probe), ("/v1/offer", replay_offer)):
        stored = await raw_post(running.url, path, build(STORED), TOKENS["beta"])
        never = await raw_post(running.url, path, build(NEVER), TOKENS["beta"])
        assert stored.status == never.status == 200, (path, stored, never)
        assert stored.body == never.body, path
    lookup = await raw_post(running.url, "/v1/lookup", replay_lookup(STORED), TOKENS["beta"])
    assert lookup.body["kv_tokens"] == lookup.body["matched_blocks"] == lookup.body["state_tokens"] == 0
    assert lookup.body["lease"] is None and lookup.body["child"] is None and lookup.body["snapshot"] is None
    offer = await raw_post(running.url, "/v1/offer", replay_offer(STORED), TOKENS["beta"])
    assert {r[1] for r in offer.body["results"]} <= {Reason.PARENT_MISSING.value, Reason.CONTAINER_MISSING.value}
    # Nothing of alpha's was pinned or leased by any of it; alpha's own answers are unchanged.
    assert len(store.leases) == leases_before and sum(e.pins for e in store.index.entries.values()) == pins_before
    async with client(running, "alpha", NS_A) as a:
        assert (await a.lookup(STORED, lease=False)).state_tokens == len(STORED)
    store.check()


@NEEDS_NIXL
async def test_a_replayed_chain_gets_no_nixl_placements(start_store: StartStore, tmp_path: Path) -> None:
    """With NIXL served, a lookup that asks for placements of alpha's chain gets none: no address
    or xxh3 of alpha's payloads ever reaches beta."""
    running = await start_tenanted(start_store, tmp_path, nixl="on", data_dir="none")
    await alpha_saves(running)
    await register_beta(running)
    stored = await raw_post(running.url, "/v1/lookup", replay_lookup(STORED, nixl=True), TOKENS["beta"])
    never = await raw_post(running.url, "/v1/lookup", replay_lookup(NEVER, nixl=True), TOKENS["beta"])
    assert stored.status == never.status == 200
    assert stored.body == never.body and stored.body["nixl"] is None
    # Alpha's own lookup does get placements: the extension works, it just never serves beta.
    own = await raw_post(running.url, "/v1/lookup", {**replay_lookup(STORED, nixl=True), "ns": NS_A.id},
                         TOKENS["alpha"])
    assert own.body["kv_tokens"] == len(STORED) and own.body["nixl"]["entries"]


async def test_a_tenant_cannot_squat_on_keys_of_another_tenants_future_blocks(
        start_store: StartStore, tmp_path: Path) -> None:
    """In a cluster a node accepts a block whose parent another node holds (the client says where
    it starts), so beta can put entries whose hashes are alpha's future blocks. They are beta's
    entries: alpha's save of those blocks later is stored whole and alpha's lookups reach its end."""
    running = await start_tenanted(start_store, tmp_path, peers="http://127.0.0.1:1,http://127.0.0.1:2")
    await register_beta(running)
    future = list(range(500, 500 + 8 * NS_A.block_tokens))
    p = Prompt(NS_A, future)
    branch = p.hashes[0]  # this node as the branch node of the prompt's first block
    squat = p.kv_items(len(future))[1:]  # blocks 2..8, keyed exactly as alpha's will be
    payloads = [kv_payload(NS_A, future, s, e) for _, s, e in squat]
    items = [dataclasses.replace(with_payload(spec, pl), start=s, branch=branch).to_wire()
             for (spec, s, _), pl in zip(squat, payloads)]
    frame = encode_frame({"ns": NS_B.id, "commit": True, "items": items}, payloads)
    async with aiohttp.ClientSession() as session:
        async with session.post(running.url + "/v1/put", data=frame, headers={
                "Authorization": f"Bearer {TOKENS['beta']}", "Content-Type": CONTENT_TYPE}) as r:
            assert r.status == 200
    assert len(running.store.index.entries) == 7  # beta stored them (in its own namespace)
    # Alpha saves the prompt here as a cluster client would (every item names its branch) and walks it.
    node = NodeClient(NS_A, ClientConfig(url=running.url, token=TOKENS["alpha"]))
    try:
        own = [(dataclasses.replace(spec, start=s, branch=branch), kv_payload(NS_A, future, s, e))
               for spec, s, e in p.kv_items(len(future))]
        results = await node.put(own)
        assert all(r.status is ItemStatus.OK for r in results), results
        req = ProbeRequest(namespace_id=NS_A.id, start=0, parent=p.root, hashes=b"".join(p.hashes[:8]),
                           tokens=p.tokens(0, 8 * NS_A.block_tokens))
        answer = await node.probe(req, lease=False)
        assert answer.held == 8 and answer.stop is None
    finally:
        await node.close()
    running.store.check()


async def test_a_huge_namespace_is_refused_before_it_is_parsed(start_store: StartStore, tmp_path: Path) -> None:
    """3.5M state shapes fit in a 7 MB frame; registering one froze a store for 14 s. Refused on
    its size (413) before parsing; a small frame over the shape bound gets a 400 naming it."""
    running = await start_tenanted(start_store, tmp_path)
    huge = NS_B.to_wire()
    huge[5] = [4, [[1, 1]] * 3_500_000, "float16"]  # type: ignore[index]
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": huge}, TOKENS["beta"])
    assert answer.status == 413 and answer.body["field"] == "body"
    over = NS_B.to_wire()
    over[5] = [4, [[1, 1]] * 17, "float16"]  # type: ignore[index]
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": over}, TOKENS["beta"])
    assert answer.status == 400 and "state.shapes" in answer.body["error"]
    assert len(running.store.namespaces) == 0


@pytest.mark.parametrize("field,value,needle", [
    ("model", "m" * 257, "model"),  # a 2 MiB name is refused on its size before this (NAMESPACE_BODY_BYTES)
    ("kv", [1 << 20, 1 << 20, 1 << 20, "float32", 2], "kv.num_layers"),  # block_bytes beyond any wire integer
    ("kv", [4096, 4096, 65536, "float32", 8], "kv"),  # in bounds per field, a block of 2^46 bytes is not
])
async def test_namespace_fields_are_bounded(start_store: StartStore, tmp_path: Path, field: str, value: object,
                                            needle: str) -> None:
    running = await start_tenanted(start_store, tmp_path)
    wire = NS_B.to_wire()
    wire[{"model": 2, "kv": 4}[field]] = value  # type: ignore[index]
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": wire}, TOKENS["beta"])
    assert 400 <= answer.status < 500 and needle in answer.body["error"], answer
    assert len(running.store.namespaces) == 0
    # A block the store could hold by the protocol's bounds but not by this node's max_body_bytes.
    big = make_namespace(tenant="beta", block_tokens=1 << 16, num_layers=4096)
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": big.to_wire()}, TOKENS["beta"])
    assert answer.status == 400 and answer.body["field"] == "namespace.kv"


async def test_namespaces_are_counted_and_charged_per_tenant(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path, max_namespaces_per_tenant=3)
    for i in range(3):
        ns = make_namespace(tenant="beta", model=f"m{i}")
        assert (await raw_post(running.url, "/v1/namespaces", {"namespace": ns.to_wire()}, TOKENS["beta"])).status == 200
    fourth = make_namespace(tenant="beta", model="m3")
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": fourth.to_wire()}, TOKENS["beta"])
    assert answer.status == 403 and answer.body["field"] == "namespace" and "max_namespaces_per_tenant" in answer.body["error"]
    again = make_namespace(tenant="beta", model="m0")  # registering one it has is idempotent
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": again.to_wire()}, TOKENS["beta"])).status == 200
    # Another tenant is not limited by beta's namespaces.
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": NS_A.to_wire()}, TOKENS["alpha"])).status == 200
    store = running.store
    assert store.tenant_bytes["beta"] == sum(store.namespace_charge(make_namespace(tenant="beta", model=f"m{i}"))
                                             for i in range(3))
    store.check()


async def test_a_namespace_record_counts_against_the_quota(start_store: StartStore, tmp_path: Path) -> None:
    tenants = write_tenants(tmp_path / "q.toml", quotas={"beta": 64})
    running = await start_tenanted(start_store, tmp_path, tenants_file=str(tenants))
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": NS_B.to_wire()}, TOKENS["beta"])
    assert answer.status == 413 and answer.body["field"] == "quota"
    assert len(running.store.namespaces) == 0 and running.store.tenant_bytes.get("beta", 0) == 0


async def test_an_offer_flood_is_bounded_per_tenant(start_store: StartStore, tmp_path: Path) -> None:
    """Every want was remembered for pending_ttl_s with no bytes moved: 535 offers of 4,096 items
    took RSS up by 284 MiB. Now a tenant's wants are capped, its own oldest forgotten first."""
    cap = 100
    running = await start_tenanted(start_store, tmp_path, max_offers_per_tenant=cap, max_items=64)
    await register_beta(running)
    async with client(running, "alpha", NS_A) as a:
        keep = Prompt(NS_A, STORED)
        mine = await a.offer([spec for spec, _, _ in keep.kv_items(len(STORED))])
        assert {r.status for r in mine} == {"want"}
    store = running.store
    assert store.held_by("alpha")["offers"] == 5
    for round_ in range(20):  # 20 offers of 64 first blocks: 1,280 wants asked for
        items = [Prompt(NS_B, [round_, i] * 2).kv_items(4)[0][0].to_wire() for i in range(64)]
        answer = await raw_post(running.url, "/v1/offer", {"ns": NS_B.id, "items": items}, TOKENS["beta"])
        assert answer.status == 200 and {r[0] for r in answer.body["results"]} == {"want"}
        assert store.held_by("beta")["offers"] <= cap
    assert store.held_by("beta")["offers"] == cap
    assert store.held_by("alpha")["offers"] == 5  # the flood forgot none of alpha's
    # A put whose want was forgotten is simply admitted afresh (KV admission: always).
    first = Prompt(NS_B, [0, 0] * 2).kv_items(4)[0][0]
    payload = kv_payload(NS_B, [0, 0, 0, 0], 0, 4)
    async with client(running, "beta", NS_B) as b:
        assert [r.status for r in await b.put([(with_payload(first, payload), payload)])] == ["ok"]
    store.check()


async def test_leases_are_bounded_per_tenant(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path, max_leases_per_tenant=4)
    await alpha_saves(running)
    async with client(running, "alpha", NS_A) as a:
        leased = [await a.lookup(STORED) for _ in range(10)]  # never released
        assert all(r.lease_id for r in leased)
        assert running.store.held_by("alpha")["leases"] == 4
        assert not await a.release(leased[0].lease_id)  # the oldest ended early ...
        assert await a.release(leased[-1].lease_id)  # ... the newest are intact
    running.store.check()


async def test_lookup_reports_cannot_poison_the_global_counters(start_store: StartStore, tmp_path: Path) -> None:
    (tmp_path / "single").mkdir()
    single = await start_tenanted(start_store, tmp_path / "single")
    await register_beta(single)
    report = {"ns": NS_B.id, "num_tokens": 1000, "kv_tokens": 0, "state_tokens": 0, "junction": None, "missing": None}
    refused = await raw_post(single.url, "/v1/lookup_report", report, TOKENS["beta"])
    assert refused.status == 404 and refused.body["field"] == "lookup_report"  # a single node takes none
    running = await start_tenanted(start_store, tmp_path, peers="http://127.0.0.1:1,http://127.0.0.1:2")
    await register_beta(running)

    def kv_misses() -> float:
        return sample(running.store, "prefixstore_lookup_tokens_total", kind="kv", result="miss")

    before = kv_misses()
    report = {"ns": NS_B.id, "num_tokens": 1 << 62, "kv_tokens": 0, "state_tokens": 0, "junction": None,
              "missing": None}
    answer = await raw_post(running.url, "/v1/lookup_report", report, TOKENS["beta"])
    assert 400 <= answer.status < 500 and answer.body["field"] == "num_tokens"
    assert kv_misses() == before
    ok = {**report, "num_tokens": running.store.config.max_lookup_tokens}
    assert (await raw_post(running.url, "/v1/lookup_report", ok, TOKENS["beta"])).status == 200


async def test_an_open_store_refuses_what_a_web_page_can_send(start_store: StartStore, tmp_path: Path) -> None:
    """Without a tenants file a page's cross-origin ``text/plain`` POST reached /v1/admin/flush."""
    running = await start_store(StoreConfig(port=0, data_dir="none", ram_bytes=4 << 20, page_bytes=4096, nixl="off"))
    ns = make_namespace()
    async with running.client(ns) as c:
        await c.save(c.prompt(STORED), len(STORED), lambda s, e: kv_payload(ns, STORED, s, e))
    held = len(running.store.index.entries)
    async with aiohttp.ClientSession() as s:
        for headers in ({"Content-Type": "text/plain"}, {},
                        {"Content-Type": "application/x-www-form-urlencoded"}):
            async with s.post(running.url + "/v1/admin/flush", data=b"x", headers=headers) as r:
                assert r.status == 415 and (await r.json())["field"] == "content-type"
        async with s.post(running.url + "/v1/admin/flush", data=b"",
                          headers={"Content-Type": CONTENT_TYPE, "Origin": "https://evil.example"}) as r:
            assert r.status == 403 and (await r.json())["field"] == "origin"
    assert len(running.store.index.entries) == held > 0


async def test_malformed_requests_are_counted_and_logged_without_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    """aiohttp logged a full traceback per request it could not parse: anyone who can connect
    could flood the log. Served the way ``prefixstore serve`` serves (StoreRunner)."""
    config = StoreConfig(port=0, data_dir="none", ram_bytes=1 << 20, page_bytes=4096, nixl="off")
    app = create_app(config)
    runner = StoreRunner(app, config)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        caplog.set_level(logging.DEBUG)
        for _ in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: nope\r\n\r\n")
            await writer.drain()
            assert (await reader.readline()).split()[1] == b"400"
            writer.close()
        lines = [r for r in caplog.records if "Error handling request" in r.getMessage()]
        assert len(lines) == 1  # one per MALFORMED_LOG_EVERY_S (10 s), however many arrive
        assert lines[0].exc_info is None and "BadHttpMessage" in lines[0].getMessage()
        assert sample(app[STORE], "prefixstore_malformed_requests_total") == 30
    finally:
        await runner.cleanup()


__all__ = ["ADMIN_TOKEN"]
