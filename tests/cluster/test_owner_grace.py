"""A scale-out does not flush the cache: for owner_grace_s after the member list changes, a miss on a
branch whose owner changed is retried on its previous owner."""

from __future__ import annotations

import asyncio
import random

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.placement import rank

from ..factories import kv_payload, make_namespace
from .conftest import free_ports

B = 4


def test_scale_out_keeps_hits_through_the_grace_window(serve, tmp_path) -> None:  # type: ignore[no-untyped-def]
    a, b, c = (f"http://127.0.0.1:{p}" for p in free_ports(3))
    old, new = f"{a},{b}", f"{a},{b},{c}"
    # Nodes a and b still have the old list; c, just added, has the new one (a rolling change).
    for url, peers in ((a, old), (b, old), (c, new)):
        serve("--port", url.rsplit(":", 1)[1], "--node-url", url, "--peers", peers,
              "--data-dir", str(tmp_path / url.rsplit(":", 1)[1]))
    ns = make_namespace(block_tokens=B, model="grace")
    rng = random.Random(3)
    prompts = [[rng.randrange(1000) for _ in range(18)] for _ in range(12)]

    async def run(grace_s: float, fill: bool) -> list[int]:
        config = ClientConfig(urls=(a,), owner_grace_s=grace_s)
        async with PrefixClient(ns, config) as facade:
            client = facade.impl
            assert isinstance(client, ClusterClient)
            await client.membership.refresh([a])
            assert client.membership.members == tuple(sorted([a, b]))
            if fill:  # the cache is filled under the old membership
                for t in prompts:
                    await client.save(client.prompt(t), len(t), lambda x, y, t=t: kv_payload(ns, t, x, y))
            assert await client.membership.refresh([c])  # the scale-out reaches this client
            assert client.membership.previous == tuple(sorted([a, b])) and c in client.membership.members
            got = []
            for t in prompts:
                res = await client.lookup(t)
                got.append(res.kv_tokens)
                await client.release(res.lease_id)
            moved = sum(rank(client.membership.members, p.hashes[0])[0] == c for p in map(client.prompt, prompts))
            assert moved > 0  # some prompts' branches now belong to the new node
            return got

    assert asyncio.run(run(300.0, fill=True)) == [18] * len(prompts)  # within the grace window: every hit kept
    assert min(asyncio.run(run(1e-9, fill=False))) < 18  # past it, the moved levels are misses
