"""One way to connect to a cluster: a single-URL client never gets silently partial answers.

A node of a multi-member cluster holds only its branches, so a lookup over its index alone would
be partial (DESIGN §8). ``PrefixClient(ns, ClientConfig(url=<one node>))`` therefore finds out on
its first call (the node's /v1/members lists more than itself), warns, and becomes a cluster client
seeded with that URL: it answers exactly as a seed-list client does. A raw single-node call to such
a node (POST /v1/lookup) is refused with 409 naming the seed-list configuration. A node without
peers is a single node and serves /v1/lookup as ever.
"""

from __future__ import annotations

import asyncio
import logging
import random
from pathlib import Path

import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.client.node import NodeClient
from prefixstore.protocol.wire import LookupRequest

from ..factories import kv_payload, make_namespace, state_payload
from ..security.helpers import raw_post
from .verified import read_verified

B = 4


def prompts(seed: int) -> list[list[int]]:
    """Conversations under one system prompt (forks) and distinct ones, 9..26 tokens."""
    rng = random.Random(seed)
    system = [rng.randrange(100) for _ in range(2 * B + 1)]
    out = [system + [rng.randrange(100) for _ in range(rng.randrange(1, 15))] for _ in range(5)]
    return out + [[rng.randrange(100) for _ in range(rng.randrange(9, 27))] for _ in range(5)]


async def save(client: PrefixClient, t: list[int]) -> None:
    ns = client.namespace
    res = await client.save(client.prompt(t), len(t), lambda a, b: kv_payload(ns, t, a, b),
                            snapshots={len(t) - 1: state_payload(ns, t, len(t) - 1)})
    assert res.stored > 0 and res.rejected == 0 and res.dropped == 0, res


def answer(res) -> tuple[int, int, int, int]:  # type: ignore[no-untyped-def]
    return res.kv_tokens, res.state_tokens, res.checkpoint_hint, res.matched_blocks


def test_a_single_url_client_of_a_cluster_node_becomes_a_cluster_client_and_answers_alike(
        make_cluster, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, "--state-admission", "always")
    ns = make_namespace(block_tokens=B, model="single-url")
    saved, later = prompts(1), prompts(2)

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(urls=tuple(cluster.urls))) as seeded, \
                PrefixClient(ns, ClientConfig(url=cluster.urls[1])) as single:
            assert isinstance(single.impl, NodeClient)
            for t in saved:
                await save(seeded, t)
            asked = [t[:k] for t in saved + later for k in (len(t), len(t) - 1, len(t) // 2)] + \
                    [t + [7, 7, 7] for t in saved]
            with caplog.at_level(logging.WARNING, logger="prefixstore.client.client"):
                first = await single.lookup(asked[0])
            assert isinstance(single.impl, ClusterClient) and single.impl.membership.seeds == (cluster.urls[1],)
            assert [r.getMessage() for r in caplog.records if "is one node of a 3-node cluster" in r.getMessage()
                    and "ClientConfig(urls=...)" in r.getMessage()], caplog.text
            await single.release(first.lease_id)
            for t in asked:  # the same answers as the seed-list client, and the same bytes
                a, b = await single.lookup(t), await seeded.lookup(t)
                assert answer(a) == answer(b), t
                assert await read_verified(single, ns, t, a) == 0
                await single.release(a.lease_id)
                await seeded.release(b.lease_id)
            assert [(await seeded.lookup(t, lease=False)).kv_tokens for t in saved] == [len(t) for t in saved]
            # Its saves land where the cluster finds them.
            for t in later:
                await save(single, t)
            for t in later:
                b = await seeded.lookup(t)
                assert b.kv_tokens == len(t) and b.state_tokens == len(t) - 1
                assert await read_verified(seeded, ns, t, b) == 0
                await seeded.release(b.lease_id)
            assert single.failures.total() == 0 and seeded.failures.total() == 0

        # A raw single-node lookup to a node of the cluster: 409, naming the seed-list configuration.
        for url in cluster.urls:
            got = await raw_post(url, "/v1/lookup", {}, None)
            assert got.status == 409 and got.body["field"] == "lookup", got
            assert "one of the 3 members of a cluster" in got.body["error"]
            assert "ClientConfig(urls=(...))" in got.body["error"]

    asyncio.run(run())


def test_a_node_without_peers_serves_single_node_lookups(serve, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    url = serve("--port", "0", "--data-dir", str(tmp_path / "single"), "--state-admission", "always").wait_ready()
    ns = make_namespace(block_tokens=B, model="single-node")
    tokens = prompts(3)[0]

    async def run() -> None:
        async with PrefixClient(ns, ClientConfig(url=url)) as client:
            await save(client, tokens)
            res = await client.lookup(tokens)
            assert isinstance(client.impl, NodeClient)  # a single node: no upgrade
            assert (res.kv_tokens, res.state_tokens) == (len(tokens), len(tokens) - 1)
            assert await read_verified(client, ns, tokens, res) == 0
            p = client.prompt(tokens)
        req = LookupRequest(namespace_id=ns.id, hashes=b"".join(p.hashes), tokens=p.packed, lease=False)
        got = await raw_post(url, "/v1/lookup", req.to_header(), None)
        assert got.status == 200 and got.body["kv_tokens"] == len(tokens), got

    asyncio.run(run())
