"""A cluster lookup on the NIXL path: every node places the payloads it reports (store/nixl_lookup.py),
so the reads that follow are one READ per node, with no /v1/nixl/get, as after a single node's lookup."""

from __future__ import annotations

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.wire import GetItem

from ..factories import kv_payload, make_namespace
from ..nixl.conftest import NEEDS_NIXL

pytestmark = NEEDS_NIXL


async def test_probes_place_payloads_and_reads_skip_the_get_call(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--nixl", "on", "--lease-ttl-s", "30")
    ns = make_namespace(block_tokens=16)
    toks = [int(t) for t in np.random.default_rng(3).integers(0, 50_000, 16 * 12)]
    async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls), data_path="nixl")) as client:
        assert isinstance(client.impl, ClusterClient)
        saved = await client.save(client.prompt(toks), len(toks), lambda a, b: kv_payload(ns, toks, a, b))
        assert saved.stored == 12  # the saves went over NIXL: every node's agent is connected now
        paths: list[str] = []
        async def observe(p: str, header: dict[str, object], answer: dict[str, object]) -> None:
            paths.append(p)

        for node in client.impl.nodes():
            node.observers.append(observe)
        looked = await client.lookup(toks)
        assert looked.kv_tokens == len(toks)
        placed = sum(len(node.data.placements) for node in client.impl.nodes())
        assert placed == 12  # each block placed by the node that reported it
        p = client.prompt(toks)
        items = [GetItem(key=p.block_key(j)) for j in range(12)]
        outs = [np.zeros(ns.block_bytes, dtype=np.uint8) for _ in items]
        assert await client.read(items, outs) == [ns.block_bytes] * 12
        assert [o.tobytes() for o in outs] == [kv_payload(ns, toks, 16 * j, 16 * (j + 1)) for j in range(12)]
        assert "/v1/nixl/get" not in paths and "/v1/get" not in paths
        assert await client.release(looked.lease_id)
        assert sum(len(node.data.placements) for node in client.impl.nodes()) == 0


async def test_prepare_sets_every_members_path_up_before_any_transfer(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--nixl", "on")
    ns = make_namespace(block_tokens=16)
    # Seeded with one member: the others are learned from its member list, and prepared too.
    async with PrefixClient(ns, ClientConfig(urls=(cluster.urls[0],))) as client:
        assert await client.prepare() is True
        assert isinstance(client.impl, ClusterClient)
        nodes = client.impl.nodes()
        assert sorted(node.config.url for node in nodes) == sorted(cluster.urls)
        assert all(node.data_path == "nixl" for node in nodes)  # each node's agent loaded ...
        assert sum(client.path_bytes.values()) == 0  # ... before any payload moved
