"""Fan-out lookups over three real store processes: placement agreement and the single-node answer."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import aiohttp

from prefixstore.client import ClientConfig, PrefixClient, Prompt, SyncPrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.client.walk import Walk
from prefixstore.protocol.placement import rank, root_branch
from prefixstore.protocol.wire import CONTENT_TYPE

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import http_get
from ..waits import wait_until


def test_nodes_and_client_agree_on_placement(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3)
    views = [json.loads(http_get(u + "/v1/members")[1]) for u in cluster.urls]
    assert all(v["members"] == sorted(cluster.urls) for v in views)
    assert [v["self"] for v in views] == cluster.urls
    ns = make_namespace()

    async def client_orders(keys: list[bytes]) -> list[list[str]]:
        client = PrefixClient(ns, ClientConfig(urls=(cluster.urls[0],))).impl
        assert isinstance(client, ClusterClient)
        try:
            await client.membership.refresh()
            assert client.membership.members == tuple(sorted(cluster.urls))
            return [client.membership.owners(k) for k in keys]
        finally:
            await client.close()

    keys = [bytes([i]) * 16 for i in range(40)]
    mine = asyncio.run(client_orders(keys))
    for key, order in zip(keys, mine):
        assert order == rank(cluster.urls, key)
        for u in cluster.urls:
            assert json.loads(http_get(f"{u}/v1/members?key={key.hex()}")[1])["order"] == order
    owners = {order[0] for order in mine}
    assert owners == set(cluster.urls)  # 40 keys over 3 nodes: each owns some


def test_a_conversation_lives_on_its_branch_node_and_reads_exact_bytes(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3)
    ns = make_namespace(block_tokens=4)
    tokens = list(range(1, 43))  # 10 full blocks + 2 tokens: 11 levels, one branch

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as client:
            p = client.prompt(tokens)
            saved = await client.save(p, 42, lambda a, b: kv_payload(ns, tokens, a, b),
                                      snapshots={41: state_payload(ns, tokens, 41)})
            assert saved.stored == 12 and saved.dropped == 0, saved
            res = await client.lookup(tokens + [7, 7])
            assert (res.kv_tokens, res.state_tokens, res.matched_blocks) == (42, 41, 10)
            walk = client.impl.last_walk
            assert walk is not None and walk.nodes == {rank(cluster.urls, p.hashes[0])[0]}, walk.nodes
            reads = res.kv_reads(42)
            bufs = [bytearray(ns.kv.payload_bytes(b - a)) for _, a, b in reads]
            got = await client.read([it for it, _, _ in reads], bufs)
            assert got == [len(b) for b in bufs]
            for (_, a, b), buf in zip(reads, bufs):
                assert bytes(buf) == kv_payload(ns, tokens, a, b)
            snap = bytearray(ns.state.snapshot_bytes)
            assert await client.read([res.state_read()], [snap]) == [len(snap)]
            assert bytes(snap) == state_payload(ns, tokens, 41)
            assert await client.release(res.lease_id)
            assert client.failures.total() == 0

    asyncio.run(run())
    # The blocking client is a cluster client too when given seed URLs.
    with SyncPrefixClient(ns, ClientConfig(urls=(cluster.urls[2],))) as sync:
        assert sync.lookup(tokens).kv_tokens == 42
    held = [json.loads(http_get(u + "/v1/stats")[1])["entries"].get("kv/disk", 0) for u in cluster.urls]
    # The whole chain (10 blocks and the tail) lives on the branch node of its first block; the
    # root level's home keeps only a record of that block (no payload, not counted as an entry).
    p = Prompt(ns, tokens)
    branch_node = rank(cluster.urls, p.hashes[0])[0]
    assert held == [11 if u == branch_node else 0 for u in cluster.urls], held


def test_conversations_spread_over_the_nodes(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """24 conversations with different first blocks: each on its own branch node, all three used. A
    lookup asks that node, and in a namespace with state the root level's home too (for snapshots
    the root level may hold: nothing deeper was found), never a third node."""
    cluster = make_cluster(3)
    ns = make_namespace(block_tokens=4, model="spread")
    prompts = [[1000 + i, *range(1, 12)] for i in range(24)]

    async def run() -> list[str]:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as client:
            for t in prompts:
                await client.save(client.prompt(t), len(t), lambda a, b, t=t: kv_payload(ns, t, a, b))
            homes = []
            for t in prompts:
                res = await client.lookup(t)
                assert res.kv_tokens == 12
                walk = client.impl.last_walk
                p = client.prompt(t)
                branch_node = rank(cluster.urls, p.hashes[0])[0]
                root_home = rank(cluster.urls, root_branch(p.root, p.tokens(0, 1)))[0]
                assert walk is not None and branch_node in walk.nodes <= {branch_node, root_home}, walk.nodes
                homes.append(branch_node)
                await client.release(res.lease_id)
            return homes

    homes = asyncio.run(run())
    ns_prompts = [Prompt(ns, t) for t in prompts]
    assert homes == [rank(cluster.urls, p.hashes[0])[0] for p in ns_prompts]
    held = [json.loads(http_get(u + "/v1/stats")[1])["entries"].get("kv/disk", 0) for u in cluster.urls]
    assert held == [3 * Counter(homes)[u] for u in cluster.urls] and all(held), held


def test_a_walk_sends_the_hops_it_learned_at_once_and_releases_the_ones_it_did_not_use(make_cluster) -> None:  # type: ignore[no-untyped-def]
    """Conversations forking after a shared system prompt: the second lookup of a conversation sends
    its fork hop beside the first (Walk.hints), the first hop asking only up to the fork, with the
    same answer and exact bytes. A prompt with the same first block is hinted only where its own
    block there is a known fork head: the conversation that continues on the system prompt's branch
    and a continuation never stored send no early hop. A hinted hop the walk does not use (the system
    prompt's node lost its entries) is released, and its head forgotten. (A first hop held through
    the level it stopped at: tests/client/test_walk.py.)"""
    cluster = make_cluster(3)
    ns = make_namespace(block_tokens=4, model="early")
    system = list(range(1, 21))  # 5 blocks
    convs = [system + [100 + 20 * i + t for t in range(12)] for i in range(12)]
    # The last conversation's fork head on another node than the system prompt's branch (else no hop).
    sys_node = rank(cluster.urls, Prompt(ns, system).hashes[0])[0]
    away = [c for c in convs if rank(cluster.urls, Prompt(ns, c).hashes[5])[0] != sys_node]
    convs = [c for c in convs if c not in away[-1:]] + away[-1:]

    def leases() -> int:
        return sum(json.loads(http_get(u + "/v1/stats")[1])["leases"] for u in cluster.urls)

    async def flush(url: str) -> None:
        async with aiohttp.ClientSession() as s, \
                s.post(url + "/v1/admin/flush", data=b"", headers={"Content-Type": CONTENT_TYPE}) as r:
            assert r.status == 200

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as client:
            impl = client.impl
            assert isinstance(impl, ClusterClient)

            def asked(walk: Walk) -> list[tuple[int, int]]:
                """(first level, levels) of each hop the walk sent."""
                return [(req.start, req.num_levels(4)) for req in walk.sent]

            for t in convs:
                res = await client.lookup(t)
                await client.release(res.lease_id)
                await client.save(client.prompt(t), len(t), lambda a, b, t=t: kv_payload(ns, t, a, b),
                                  start=res.kv_tokens - res.kv_tokens % 4)
            t = convs[-1]
            first = await client.lookup(t)
            walk1 = impl.last_walk
            await client.release(first.lease_id)
            assert walk1 is not None and walk1.fork_levels == [5], walk1.fork_levels
            again = await client.lookup(t)
            walk2 = impl.last_walk
            assert walk2 is not None and walk2.hints == (5,) and walk2.sent_early == 1 and walk2.fork_levels == [5]
            # Each node its part (levels 0-5, then 5-7), then single-level follow-ups (root snapshots).
            sent = asked(walk2)
            assert sorted(sent[:2]) == [(0, 6), (5, 3)] and all(k == 1 for _, k in sent[2:]), sent
            assert (again.kv_tokens, again.matched_blocks) == (first.kv_tokens, first.matched_blocks) == (32, 8)
            assert [(a.start, a.held) for _, a in walk2.answered] == [(a.start, a.held) for _, a in walk1.answered]
            reads = again.kv_reads(32)
            bufs = [bytearray(ns.kv.payload_bytes(b - a)) for _, a, b in reads]
            assert await client.read([it for it, _, _ in reads], bufs) == [len(b) for b in bufs]
            assert b"".join(bufs) == b"".join(kv_payload(ns, t, a, b) for _, a, b in reads)
            await client.release(again.lease_id)
            # Same first block and fork level, not a known head: no early hop, one hop of all levels.
            for other, kv in ((convs[0], 32), (system + [999] * 12, 20)):  # continues on the branch; never stored
                res = await client.lookup(other)
                walk3 = impl.last_walk
                assert walk3 is not None and walk3.hints == () and walk3.sent_early == 0
                assert (res.kv_tokens, asked(walk3)[0]) == (kv, (0, 8)), (res.kv_tokens, asked(walk3))
                await client.release(res.lease_id)
            # The system prompt's node loses its entries: the hinted hop is sent (the head's node leases
            # its part) and not used, released, and the head forgotten.
            await flush(sys_node)
            lost = await client.lookup(t)
            walk4 = impl.last_walk
            assert walk4 is not None and walk4.sent_early == 1 and walk4.fork_levels == [] and lost.kv_tokens < 20
            await client.release(lost.lease_id)
            await wait_until(lambda: leases() == 0, "the unused hop's lease released (in the background)")
            res = await client.lookup(t)
            await client.release(res.lease_id)
            walk5 = impl.last_walk
            assert walk5 is not None and walk5.hints == ()  # the head the walk did not follow is forgotten
            assert client.failures.total() == 0

    asyncio.run(run())
    assert leases() == 0
