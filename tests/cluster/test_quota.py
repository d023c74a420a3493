"""Tenant quotas in a cluster are per node: a tenant may hold up to ``quota_bytes`` on EACH node.

Every node enforces the tenants file on what it holds itself (store/ledger.py); nodes do not add
up a tenant's bytes across the cluster (no coordination, DESIGN §8). So a cluster of N nodes holds
up to N x quota of one tenant, and a node at the quota refuses that tenant's new items with
``tenant quota exceeded`` while the other nodes keep taking the tenant's branches that live there.

The conversations here are each placed whole on one node (its first block ranks that node first,
and so does its root level's key), so every byte of the arithmetic is on one node.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import aiohttp

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.placement import rank, root_branch
from prefixstore.store.index import entry_charge
from prefixstore.store.ledger import namespace_charge

from ..factories import kv_payload, make_namespace
from ..security.helpers import ADMIN_TOKEN, CLUSTER_TOKEN, TOKENS, write_tenants
from .verified import read_verified

B = 4
LENGTH = 2 * B  # a conversation: two full blocks
FIT = 3  # conversations that fit in the quota on one node


async def stats(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/v1/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as r:
            assert r.status == 200
            body: dict[str, Any] = await r.json()
            return body


async def quota_rejections(url: str, tenant: str) -> float:
    async with aiohttp.ClientSession() as s:
        async with s.get(url + "/metrics") as r:
            text = await r.text()
    m = re.search(rf'^prefixstore_quota_rejections_total{{tenant="{tenant}"}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_quota_is_per_node_a_full_node_refuses_and_the_others_take_the_tenants_branches(
        make_cluster, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    ns = make_namespace(block_tokens=B, with_state=False, tenant="alpha", model="quota")
    beta_ns = make_namespace(block_tokens=B, with_state=False, tenant="beta", model="quota")
    block = entry_charge(ns.block_bytes, b"\0" * 4 * B, b"")  # payload, tokens and the entry's overhead
    quota = namespace_charge(ns) + FIT * LENGTH // B * block  # FIT conversations and the namespace record
    tenants = write_tenants(tmp_path / "tenants.toml", {"alpha": quota})
    token_file = tmp_path / "cluster-token"
    token_file.write_text(CLUSTER_TOKEN)
    cluster = make_cluster(3, "--tenants-file", str(tenants), "--cluster-token-file", str(token_file),
                           "--replication-max-replicas", "1")
    full, other = cluster.urls[0], cluster.urls[1]

    async def run() -> None:
        config = ClientConfig(urls=tuple(cluster.urls), token=TOKENS["alpha"])
        async with PrefixClient(ns, config) as alpha, \
                PrefixClient(beta_ns, ClientConfig(urls=tuple(cluster.urls), token=TOKENS["beta"])) as beta:
            def whole_on(client: PrefixClient, node: str, n: int, start: int) -> list[list[int]]:
                """n conversations of ``client``'s namespace placed whole on ``node`` (tokens from
                ranges of their own)."""
                impl = client.impl
                assert isinstance(impl, ClusterClient)
                out: list[list[int]] = []
                i = start
                while len(out) < n:
                    t = [i * 100 + j for j in range(LENGTH)]
                    p = client.prompt(t)
                    if rank(cluster.urls, p.hashes[0])[0] == node == \
                            rank(cluster.urls, root_branch(impl.namespace_root, p.tokens(0, 1)))[0]:
                        out.append(t)
                    i += 1
                return out

            async def save(client: PrefixClient, t: list[int]):  # type: ignore[no-untyped-def]
                return await client.save(client.prompt(t), LENGTH, lambda a, b: kv_payload(client.namespace, t, a, b))

            on_full = whole_on(alpha, full, FIT + 1, 1000)
            for t in on_full[:FIT]:
                res = await save(alpha, t)
                assert (res.stored, res.rejected, res.dropped) == (LENGTH // B, 0, 0), res
            # The node is at the quota, to the byte: the next conversation there is refused ...
            assert (await stats(full))["tenants"]["alpha"] == {"stored_bytes": quota, "quota_bytes": quota}
            before = await quota_rejections(full, "alpha")
            res = await save(alpha, on_full[FIT])
            assert (res.stored, res.dropped) == (0, 0) and res.rejected == LENGTH // B, res
            assert await quota_rejections(full, "alpha") == before + LENGTH // B  # ... each item for the quota
            assert (await stats(full))["tenants"]["alpha"]["stored_bytes"] == quota

            # ... while another node takes the tenant's branches that live there, up to the quota again.
            on_other = whole_on(alpha, other, FIT + 1, 100_000)
            for t in on_other[:FIT]:
                res = await save(alpha, t)
                assert (res.stored, res.rejected, res.dropped) == (LENGTH // B, 0, 0), res
            assert (await stats(other))["tenants"]["alpha"] == {"stored_bytes": quota, "quota_bytes": quota}
            before = await quota_rejections(other, "alpha")
            assert (await save(alpha, on_other[FIT])).rejected == LENGTH // B
            assert await quota_rejections(other, "alpha") == before + LENGTH // B
            # So the cluster holds 2 x quota of alpha (N x quota at most): the per-node meaning.
            held = [(await stats(u))["tenants"].get("alpha", {}).get("stored_bytes", 0) for u in cluster.urls]
            assert held[0] == held[1] == quota and sum(held) > quota
            assert all(h <= quota for h in held)

            # What was stored is served whole; what was refused is a miss.
            for t in on_full + on_other:
                found = await alpha.lookup(t)
                refused = t in (on_full[FIT], on_other[FIT])
                assert found.kv_tokens == (0 if refused else LENGTH), t
                assert await read_verified(alpha, ns, t, found) == 0
                await alpha.release(found.lease_id)
            # Another tenant is not held back by alpha's quota on the full node.
            t = whole_on(beta, full, 1, 1000)[0]
            res = await save(beta, t)
            assert (res.stored, res.rejected, res.dropped) == (LENGTH // B, 0, 0), res

    asyncio.run(run())
