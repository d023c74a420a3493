"""A scale-out does not flush the cache: for owner_grace_s after the member list changes, a miss on a
branch whose owner changed is retried on its previous owner."""

from __future__ import annotations

import asyncio
import random

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.placement import rank, root_branch

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
    prompts = [[rng.randrange(1000) for _ in range(18)] for _ in range(40)]

    def gone(client: ClusterClient, t: list[int]) -> bool:
        """Whether the scale-out took the prompt from every node a walk asks without the grace window.
        Saved under the old list, the prompt lives on its first block's branch node then (its whole
        conversation, one branch). Under the new list a walk asks the new branch node of that block
        and, when that one holds nothing, the root level's home: a prompt whose old holder is still
        one of those two is found there, grace window or not (a hit from a home, not a retry)."""
        p = client.prompt(t)
        m = client.membership
        held = rank(m.previous, p.hashes[0])[0]
        asked = {rank(m.members, p.hashes[0])[0], rank(m.members, root_branch(p.root, p.tokens(0, 1)))[0]}
        return held not in asked

    async def run(grace_s: float, fill: bool) -> tuple[list[int], list[bool]]:
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
            return got, [gone(client, t) for t in prompts]

    kept, moved = asyncio.run(run(300.0, fill=True))
    assert kept == [18] * len(prompts)  # within the grace window: every hit kept
    assert sum(moved) > 0  # some prompts moved off every node a walk asks (40 prompts: nearly sure)
    past, _ = asyncio.run(run(1e-9, fill=False))
    # Past the window, the moved prompts are misses and the rest still hit.
    assert [n < 18 for n in past] == moved, (past, moved)
