"""Tenant isolation against a real store: bearer tokens, namespaces owned by tenants, quotas, admin calls."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.results import LookupResult
from prefixstore.protocol import Kind, Namespace, make_entry_key
from prefixstore.client.prompt import with_payload
from prefixstore.protocol.errors import Reason
from prefixstore.protocol.wire import CONTENT_TYPE, GetItem, encode_frame
from prefixstore.store import StoreConfig
from prefixstore.store.core import Store
from prefixstore.store.index import entry_charge
from prefixstore.store.config import ConfigError
from prefixstore.store.tenants import load_tenants, token_sha256

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace
from ..samples import sample
from .helpers import ADMIN_TOKEN, CLUSTER_TOKEN, TOKENS, raw_get, raw_post, write_tenants

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
TOKENS_LIST = [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 0, 11, 12, 13, 14, 15, 16, 17]  # 4 full blocks + a 2-token tail


def tenant_client(running: RunningStore, tenant: str, ns: Namespace | None = None, **overrides: object) -> PrefixClient:
    overrides.setdefault("token", TOKENS[tenant])
    return PrefixClient(ns or make_namespace(tenant=tenant), ClientConfig(url=running.url, **overrides))


async def save_all(c: PrefixClient, tokens: list[int]) -> None:
    prompt = c.prompt(tokens)
    res = await c.save(prompt, len(tokens), lambda a, b: kv_payload(c.namespace, tokens, a, b))
    assert res.stored > 0 and res.rejected == 0 and res.dropped == 0, res


async def read_and_check(c: PrefixClient, found: LookupResult, tokens: list[int]) -> None:
    """Read every KV entry the lookup matched (the bulk GET path) and compare it with what was saved."""
    reads = found.kv_reads(len(tokens))
    outs = [bytearray(1 << 12) for _ in reads]
    sizes = await c.read([item for item, _, _ in reads], outs)
    for (_, a, b), out, n in zip(reads, outs, sizes):
        assert n > 0 and bytes(out[:n]) == kv_payload(c.namespace, tokens, a, b)


async def start_tenanted(start_store: StartStore, tmp_path: Path, quotas: dict[str, int] | None = None
                         ) -> RunningStore:
    tenants = write_tenants(tmp_path / "tenants.toml", quotas)
    return await start_store(StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20,
                                         page_bytes=4096, disk_bytes=64 << 20, tenants_file=str(tenants)))


async def test_identical_tokens_of_two_tenants_are_distinct_entries(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path)
    async with tenant_client(running, "alpha") as a, tenant_client(running, "beta") as b:
        await save_all(a, TOKENS_LIST)
        n_alpha = len(running.store.index.entries)
        await save_all(b, TOKENS_LIST)  # same tokens: nothing is "already there" for beta
        assert len(running.store.index.entries) == 2 * n_alpha
        pa, pb = a.prompt(TOKENS_LIST), b.prompt(TOKENS_LIST)
        assert not {pa.block_key(j) for j in range(4)} & {pb.block_key(j) for j in range(4)}
        for c in (a, b):
            found = await c.lookup(TOKENS_LIST)
            assert found.kv_tokens == len(TOKENS_LIST)
            await read_and_check(c, found, TOKENS_LIST)
        # Payload bytes alike; each tenant is also charged its namespace's record.
        held = {t: running.store.tenant_bytes[t] - running.store.namespace_charge(c.namespace)
                for t, c in (("alpha", a), ("beta", b))}
        assert held["alpha"] == held["beta"] > 0
        assert a.failures == {} and b.failures == {}
    running.store.check()


async def test_no_cross_tenant_lookup_read_commit_or_overwrite(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path)
    ns_a, ns_b = make_namespace(tenant="alpha"), make_namespace(tenant="beta")
    async with tenant_client(running, "alpha", ns_a) as a, tenant_client(running, "beta", ns_b) as b:
        await save_all(a, TOKENS_LIST)
        await b.lookup([1])  # registers beta's namespace
        # Beta looks the same prompt up in its own namespace: nothing.
        assert (await b.lookup(TOKENS_LIST)).kv_tokens == 0
        # Beta asks for alpha's entry keys in its own namespace: missing, no bytes.
        keys = [a.prompt(TOKENS_LIST).block_key(j) for j in range(4)]
        outs = [bytearray(1 << 12) for _ in keys]
        assert await b.read([GetItem(key=k) for k in keys], outs) == [-1] * len(keys)
        answer = await raw_post(running.url, "/v1/get", {"ns": ns_b.id, "items": [[k, 0, None] for k in keys]},
                                TOKENS["beta"])
        assert answer.status == 200 and all(item[0] == "missing" for item in answer.body["items"])
        # Commit of alpha's keys through beta's namespace: missing, nothing changes.
        answer = await raw_post(running.url, "/v1/commit", {"ns": ns_b.id, "keys": keys}, TOKENS["beta"])
        assert [r[0] for r in answer.body["results"]] == ["missing"] * len(keys)
        # Beta names alpha's namespace: registering is forbidden, everything else looks unknown.
        answer = await raw_post(running.url, "/v1/namespaces", {"namespace": ns_a.to_wire()}, TOKENS["beta"])
        assert answer.status == 403 and answer.body["field"] == "ns"
        unknown = await raw_post(running.url, "/v1/offer", {"ns": make_namespace(tenant="nobody").id, "items": []},
                                 TOKENS["beta"])
        prompt_a = a.prompt(TOKENS_LIST)
        calls = {
            "/v1/lookup": {"ns": ns_a.id, "hashes": b"".join(prompt_a.hashes),
                           "tokens": prompt_a.tokens(0, len(TOKENS_LIST))},
            "/v1/offer": {"ns": ns_a.id, "items": []},
            "/v1/commit": {"ns": ns_a.id, "keys": keys},
            "/v1/get": {"ns": ns_a.id, "items": [[k, 0, None] for k in keys]},
        }
        for path, header in calls.items():
            answer = await raw_post(running.url, path, header, TOKENS["beta"])
            assert answer.status == 404 and answer.body["field"] == "ns", (path, answer)
            # Word for word the answer to a namespace nobody registered, but for the id.
            assert answer.body["error"].replace(ns_a.id.hex(), "") == \
                unknown.body["error"].replace(make_namespace(tenant="nobody").id.hex(), "")
        # Alpha still reads its own entries whole.
        assert (await a.lookup(TOKENS_LIST)).kv_tokens == len(TOKENS_LIST)
        assert a.failures == {}
    running.store.check()


async def test_missing_or_bad_tokens_are_refused_then_a_good_one_works(start_store: StartStore, tmp_path: Path) -> None:
    running = await start_tenanted(start_store, tmp_path)
    ns = make_namespace(tenant="alpha")
    for token in (None, "wrong-token", TOKENS["alpha"] + "x", ADMIN_TOKEN):
        answer = await raw_post(running.url, "/v1/namespaces", {"namespace": ns.to_wire()}, token)
        assert answer.status == 401 and answer.body["field"] == "authorization", (token, answer)
    # A scheme other than Bearer is refused too.
    async with aiohttp.ClientSession() as s:
        async with s.post(running.url + "/v1/lookup", data=b"x", headers={"Authorization": f"Basic {TOKENS['alpha']}",
                                                                          "Content-Type": CONTENT_TYPE}) as r:
            assert r.status == 401 and r.headers["WWW-Authenticate"].startswith("Bearer")
    # A client with a bad token: misses, counted, no exception; the bulk read path is refused as well.
    async with tenant_client(running, "alpha", ns, token="not-a-tenant") as bad:
        assert (await bad.lookup(TOKENS_LIST)).kv_tokens == 0
        assert await bad.read([GetItem(key=make_entry_key(1, b"\0" * 16))], [bytearray(16)]) == [-1]
        assert bad.failures["lookup"] >= 1 and bad.failures["read"] >= 1
    async with tenant_client(running, "alpha", ns) as good:
        await save_all(good, TOKENS_LIST)
        found = await good.lookup(TOKENS_LIST)
        assert found.kv_tokens == len(TOKENS_LIST)
        await read_and_check(good, found, TOKENS_LIST)
        assert good.failures == {}
    # Open endpoints stay open; admin endpoints need the admin token.
    assert await raw_get(running.url, "/healthz") == 200
    assert await raw_get(running.url, "/metrics") == 200
    assert await raw_get(running.url, "/v1/stats") == 401
    assert await raw_get(running.url, "/v1/stats", TOKENS["alpha"]) == 401
    assert await raw_get(running.url, "/v1/stats", ADMIN_TOKEN) == 200
    assert await raw_get(running.url, "/v1/admin/flush", TOKENS["alpha"], method="POST") == 401
    assert sample(running.store, "prefixstore_auth_failures_total") >= 8


async def test_quota_exhaustion_rejects_items_and_frees_on_delete(start_store: StartStore, tmp_path: Path) -> None:
    ns = make_namespace(tenant="alpha")
    # A block is charged its payload and its record (store/index.py entry_charge); a registered
    # namespace is charged too.
    block_bytes = entry_charge(ns.block_bytes, b"\0" * 4 * ns.block_tokens, b"")
    record = Store.namespace_charge(ns)
    running = await start_tenanted(start_store, tmp_path, quotas={"alpha": 2 * block_bytes + record})
    tokens = list(range(100, 100 + 4 * ns.block_tokens))  # 4 full blocks
    async with tenant_client(running, "alpha", ns) as a, tenant_client(running, "beta") as b:
        prompt = a.prompt(tokens)
        specs = [spec for spec, _, _ in prompt.kv_items(len(tokens))]
        payloads = [kv_payload(ns, tokens, spec_start, spec_end) for _, spec_start, spec_end in prompt.kv_items(len(tokens))]
        # Offers already say so (no bytes are sent for a refused item) ...
        offered = await a.offer(specs)
        assert [r.status for r in offered] == ["want", "want", "rejected", "rejected"]
        assert offered[2].reason is Reason.QUOTA
        # ... and a put over the quota is refused whole with a clear 413, nothing stored ...
        async with aiohttp.ClientSession() as s:
            frame = encode_frame({"ns": ns.id, "commit": True, "items": [
                with_payload(sp, pl).to_wire() for sp, pl in zip(specs, payloads)]}, payloads)
            async with s.post(running.url + "/v1/put", data=frame,
                              headers={"Authorization": f"Bearer {TOKENS['alpha']}", "Content-Type": CONTENT_TYPE}) as r:
                assert r.status == 413
                body = await r.json()
                assert body["field"] == "quota" and "alpha" in body["error"] and "items [2]" in body["error"]
        assert running.store.tenant_bytes.get("alpha", 0) == record and not running.store.pending
        results = await a.put(list(zip(specs, payloads)))
        assert [(r.status, r.reason) for r in results] == [("dropped", Reason.QUOTA)] * 4
        assert a.failures["quota"] == 1  # never silent: counted and warned
        # What fits goes through.
        assert [r.status for r in await a.put(list(zip(specs[:2], payloads[:2])))] == ["ok", "ok"]
        assert running.store.tenant_bytes["alpha"] == 2 * block_bytes + record
        assert (await a.lookup(tokens)).kv_tokens == 2 * ns.block_tokens
        # Another tenant is not limited by alpha's quota.
        await save_all(b, tokens)
        # Deleting entries returns their bytes to the quota.
        async with aiohttp.ClientSession() as s:
            async with s.post(running.url + "/v1/admin/flush", headers={"Authorization": f"Bearer {ADMIN_TOKEN}",
                                                                         "Content-Type": CONTENT_TYPE}) as r:
                assert r.status == 200 and (await r.json())["flushed"] > 0
        assert running.store.tenant_bytes.get("alpha", 0) == record
        assert running.store.tenant_bytes.get("beta", 0) == Store.namespace_charge(b.namespace)
        assert len(running.store.index.entries) == 0
        results = await a.put(list(zip(specs[:2], payloads[:2])))
        assert [r.status for r in results] == ["ok", "ok"]
        metrics = sample(running.store, "prefixstore_quota_rejections_total", tenant="alpha")
        assert metrics == 3  # block 3 in the offer, the raw put and the client's put (block 4 then lacks its parent)
    running.store.check()


def test_tenants_file_errors_name_the_knob(tmp_path: Path) -> None:
    bad = tmp_path / "t.toml"
    for text, needle in [
        ("", "at least one tenant"),
        ('[tenants.a]\ntoken_sha256 = "abc"\n', "tenants.a.token_sha256"),
        (f'[tenants.a]\ntoken_sha256 = "{token_sha256("x")}"\nquota = 3\n', "unknown key"),
        (f'[tenants.a]\ntoken_sha256 = "{token_sha256("x")}"\n[tenants.b]\ntoken_sha256 = "{token_sha256("x")}"\n',
         "share a token"),
        (f'[tenants.a]\ntoken_sha256 = "{token_sha256("x")}"\nquota_bytes = "lots"\n', "quota_bytes"),
    ]:
        bad.write_text(text)
        with pytest.raises(ConfigError, match="tenants_file") as err:
            StoreConfig(tenants_file=str(bad))
        assert needle in str(err.value)
    with pytest.raises(ConfigError, match="tenants_file"):
        StoreConfig(tenants_file=str(tmp_path / "absent.toml"))
    good = tmp_path / "t.json"
    good.write_text(f'{{"tenants": {{"a": {{"token_sha256": "{token_sha256("x")}", "quota_bytes": "1KiB"}}}}}}')
    tenants = load_tenants(good)
    assert tenants.authenticate("x") is not None and tenants.authenticate("y") is None
    assert tenants.quota_of("a") == 1024 and not tenants.is_admin("x")


async def test_the_cluster_token_pushes_replicas_into_any_tenant_and_does_nothing_else(
        start_store: StartStore, tmp_path: Path) -> None:
    """The node-to-node credential: registers any tenant's namespace and puts committed replicas there;
    never looks up, reads, offers, commits, or puts ordinary entries."""
    running = await start_tenanted(start_store, tmp_path)
    ns_a = make_namespace(tenant="alpha")
    async with tenant_client(running, "alpha", ns_a) as a:
        await save_all(a, TOKENS_LIST)
        prompt = a.prompt(TOKENS_LIST)
    assert (await raw_post(running.url, "/v1/namespaces", {"namespace": ns_a.to_wire()}, CLUSTER_TOKEN)).status == 200
    block = [make_entry_key(Kind.BLOCK, prompt.hashes[0])]
    refused = {
        "/v1/lookup": {"ns": ns_a.id, "hashes": b"".join(prompt.hashes), "tokens": prompt.tokens(0, len(TOKENS_LIST))},
        "/v1/get": {"ns": ns_a.id, "items": [[block[0], 0, None]]},
        "/v1/offer": {"ns": ns_a.id, "items": []},
        "/v1/commit": {"ns": ns_a.id, "keys": block},
    }
    for path, header in refused.items():
        answer = await raw_post(running.url, path, header, CLUSTER_TOKEN)
        assert answer.status == 401 and answer.body["field"] == "authorization", (path, answer)
    for path in ("/v1/stats",):
        assert await raw_get(running.url, path, CLUSTER_TOKEN) == 401
    # A put that is not a committed replica push is refused before any payload is read.
    spec = with_payload(prompt.kv_items(4)[0][0], kv_payload(ns_a, TOKENS_LIST, 0, 4))
    for extra in ({}, {"replica": True, "commit": False}):
        header = {"ns": ns_a.id, "items": [spec.to_wire()], **extra}
        answer = await raw_post(running.url, "/v1/put", header, CLUSTER_TOKEN)
        assert answer.status == 403 and answer.body["field"] == "replica", answer
    # A tenant's own token cannot pose as a replica push into another tenant.
    answer = await raw_post(running.url, "/v1/namespaces", {"namespace": ns_a.to_wire()}, TOKENS["beta"])
    assert answer.status == 403
    running.store.check()
