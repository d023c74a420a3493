"""Hot-prefix replication on three real nodes: a hot block gets replicas on the next nodes in rendezvous
order, lookups carry the replica set, reads spread over the copies with the right bytes, and the
replicas are dropped (the primary kept) once the block cools."""

from __future__ import annotations

import asyncio
import re
import time

from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.protocol.placement import rank, root_branch

from ..factories import kv_payload, make_namespace
from ..serve_process import http_get


def metric(url: str, name: str, labels: str = "") -> float:
    text = http_get(url + "/metrics")[1].decode()
    pattern = r"(?m)^" + re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)$"
    m = re.search(pattern, text)
    return float(m.group(1)) if m else 0.0


def gets(url: str) -> float:
    """Reads served, on either data path."""
    return sum(metric(url, "prefixstore_requests_total", f'endpoint="{path}",status="2xx"')
               for path in ("/v1/get", "/v1/nixl/get"))


def test_hot_block_is_replicated_spread_and_dropped_when_cold(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--replication-threshold", "2", "--replication-half-life-s", "0.5",
                           "--replication-max-replicas", "3")
    ns = make_namespace(block_tokens=4, model="hot")
    tokens = list(range(100, 108))  # two blocks

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as client:
            p = client.prompt(tokens)
            await client.save(p, 8, lambda a, b: kv_payload(ns, tokens, a, b))
            hot = p.block_key(0)
            primary = rank(cluster.urls, p.hashes[0])[0]  # the branch node of the first block
            root_home = rank(cluster.urls, root_branch(p.root, p.tokens(0, 1)))[0]
            copies = 3 if root_home == primary else 2
            buf = bytearray(ns.kv.payload_bytes(4))
            deadline = time.monotonic() + 20.0
            while True:  # read the first block hard until its owner has pushed two replicas
                res = await client.lookup(tokens)
                got = await client.read([it for it, _, _ in res.kv_reads(4)], [buf])
                assert got == [len(buf)] and bytes(buf) == kv_payload(ns, tokens, 0, 4)
                await client.release(res.lease_id)
                # The root level's home keeps a record of this first block (a fork head) and refuses
                # its payload: when that is not the primary, one copy fewer fits on three nodes.
                if len(client.impl.replicas_of(hot, time.monotonic())) == copies:
                    break
                assert time.monotonic() < deadline, "no replicas were pushed"
            assert metric(primary, "prefixstore_replication_pushes_total", 'result="ok"') >= copies - 1
            others = [u for u in cluster.urls if u != primary and (u != root_home or copies == 3)]
            deadline = time.monotonic() + 10.0  # the receivers' gauges follow within a tick
            while not all(metric(u, "prefixstore_replicas", 'kind="kv"') >= 1 for u in others):
                assert time.monotonic() < deadline, "the receivers do not count their replicas"
                await asyncio.sleep(0.05)
            # Reads now spread over the copies, every one verified.
            before = {u: gets(u) for u in cluster.urls}
            for _ in range(60):
                res = await client.lookup(tokens)
                got = await client.read([it for it, _, _ in res.kv_reads(4)], [buf])
                assert got == [len(buf)] and bytes(buf) == kv_payload(ns, tokens, 0, 4)
                await client.release(res.lease_id)
            served = {u: gets(u) - before[u] for u in cluster.urls}
            assert all(served[u] > 0 for u in others), served
        # Cold now: the owner drops the replicas (a replica that is the parent of entries a node holds
        # in its own right stays as an ordinary entry, no longer a replica), never its own copy.
        deadline = time.monotonic() + 20.0
        while any(metric(u, "prefixstore_replicas", 'kind="kv"') for u in others):
            assert time.monotonic() < deadline, "replicas of a cold block were not dropped"
            await asyncio.sleep(0.2)
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as client:
            assert (await client.lookup(tokens)).kv_tokens == 8

    asyncio.run(run())


def test_replicas_are_pushed_with_the_cluster_token_when_the_cluster_has_tenants(
        make_cluster, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Tenants on every node: pushes carry cluster_token_file's token and land in the tenant's namespace."""
    from ..security.helpers import CLUSTER_TOKEN, TOKENS, write_tenants

    tenants = write_tenants(tmp_path / "tenants.toml")
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN + "\n")
    cluster = make_cluster(2, "--replication-threshold", "2", "--replication-max-replicas", "2",
                           "--tenants-file", str(tenants), "--cluster-token-file", str(token_file))
    ns = make_namespace(block_tokens=4, model="hot-tenant", tenant="alpha")

    def placed_whole(tokens: list[int]) -> bool:  # the root level's home is the branch node: no record elsewhere
        p = Prompt(ns, tokens)
        return rank(cluster.urls, p.hashes[0])[0] == rank(cluster.urls, root_branch(p.root, p.tokens(0, 1)))[0]

    tokens = next(t for t in (list(range(b, b + 4)) for b in range(200, 400)) if placed_whole(t))

    async def run() -> None:
        config = ClientConfig(urls=tuple(cluster.urls), token=TOKENS["alpha"])
        async with PrefixClient(ns, config) as client:
            p = client.prompt(tokens)
            await client.save(p, 4, lambda a, b: kv_payload(ns, tokens, a, b))
            primary = rank(cluster.urls, p.hashes[0])[0]  # the branch node of the first block
            other = next(u for u in cluster.urls if u != primary)
            buf = bytearray(ns.kv.payload_bytes(4))
            deadline = time.monotonic() + 20.0
            while metric(other, "prefixstore_replicas", 'kind="kv"') < 1:
                res = await client.lookup(tokens)
                got = await client.read([it for it, _, _ in res.kv_reads(4)], [buf])
                assert got == [len(buf)] and bytes(buf) == kv_payload(ns, tokens, 0, 4)
                await client.release(res.lease_id)
                assert time.monotonic() < deadline, "no replica arrived"
            assert metric(primary, "prefixstore_replication_pushes_total", 'result="failed"') == 0
            assert metric(other, "prefixstore_auth_failures_total") == 0

    asyncio.run(run())
