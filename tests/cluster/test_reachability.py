"""Node join and leave on real processes, with the reachable fraction of the cache MEASURED.

Three nodes with static ``--peers`` lists are filled with conversations: several under one shared
system prompt (the first continues the system prompt's branch, each later one forks a branch of
its own where it leaves the system prompt) and distinct ones (a branch each). Then the member
list changes by a rolling restart (every node restarted on its LMDB directory with the new list),
and every conversation is looked up and its bytes read back.

The design's figures (DESIGN §8, protocol/placement.py), asserted exactly, conversation by
conversation, from the rendezvous ranks of the branch keys (a conversation's first block, a fork
head):

* join (3 -> 4): within owner_grace_s every saved token is reachable (the client also asks a moved
  branch's previous owner); after it, a conversation keeps its tokens up to the first branch whose
  owner moved, and owners move only to the new node. (A first block kept whole at the root level's
  home -- its owner is that home -- is still found there while that home has not moved.)
* leave (a node removed from the list, its process stopped): a conversation keeps its tokens up to
  the first branch that lived on the removed node; no other branch moves.

``pytest -s`` prints the measured fractions.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from dataclasses import dataclass

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.cluster import ClusterClient
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.placement import rank, root_branch

from ..factories import kv_payload, make_namespace
from .conftest import Cluster, free_ports
from .verified import read_verified

B = 4
SYSTEM = 3 * B  # the shared system prompt: 3 full blocks, so conversations fork at level 3
SUFFIX = 3 * B + 2  # what each conversation adds: 3 blocks and a 2-token tail
SHARED, OWN = 8, 12  # conversations under the system prompt, and distinct ones
KNOBS = ("--replication-max-replicas", "1")  # no hot copies: a moved branch would survive on a copy
GRACE_S = 300.0


@dataclass(frozen=True)
class Branch:
    start: int  # the conversation's first token held on it
    key: bytes  # its branch key (the block whose hash placed it)
    node: str  # where the fill put it
    also: bytes | None = None  # the root level's key, when the fill kept the branch whole at that level's home

    def found(self, members: list[str]) -> bool:
        """Whether a walk over ``members`` reaches this branch's node: the owner of its key, or of
        the root level's key when the branch is kept there (the walk asks the root level's home
        when the first block's owner does not hold it, client/walk.py)."""
        return any(k is not None and rank(members, k)[0] == self.node for k in (self.key, self.also))


@dataclass(frozen=True)
class Conversation:
    tokens: list[int]
    branches: tuple[Branch, ...]

    def reachable(self, alive: Callable[[Branch], bool]) -> int:
        """Tokens a lookup reaches: up to the first branch that is not."""
        for b in self.branches:
            if not alive(b):
                return b.start
        return len(self.tokens)


def workload(seed: int) -> list[Conversation]:
    """SHARED conversations under one system prompt (the first continues its branch), then OWN
    distinct ones. Each conversation draws its tokens from a range of its own, so no stored child
    of another agrees with it for even one token: a lookup's answer is whole branches."""
    rng = random.Random(seed)
    system = [rng.randrange(1000) for _ in range(SYSTEM)]
    out = []
    for c in range(SHARED + OWN):
        base = (c + 1) * 10_000
        own = [base + rng.randrange(1000) for _ in range(SUFFIX if c < SHARED else SYSTEM + SUFFIX)]
        tokens = system + own if c < SHARED else own
        out.append(Conversation(tokens, ()))
    return out


def placed(client: PrefixClient, convs: list[Conversation], members: list[str]) -> list[Conversation]:
    """Each conversation's branches as the save placed them (client/saves.py): the first block's
    branch (on the node its hash ranks first; kept whole there, without a record at the root level's
    home, when that node is the home); for a conversation under the system prompt but the first,
    the fork head at level 3 on the node its hash ranks first, unless that is the system prompt's
    node (then it stays whole there)."""
    out = []
    for c, conv in enumerate(convs):
        p = client.prompt(conv.tokens)
        h = p.hashes
        node = rank(members, h[0])[0]
        root = root_branch(cluster_of(client).namespace_root, p.tokens(0, 1))
        first = Branch(0, h[0], node, root if rank(members, root)[0] == node else None)
        branches = [first]
        if 0 < c < SHARED:
            node = rank(members, h[SYSTEM // B])[0]
            if node != first.node:
                branches.append(Branch(SYSTEM, h[SYSTEM // B], node))
        out.append(Conversation(conv.tokens, tuple(branches)))
    return out


async def save_all(client: PrefixClient, ns: Namespace, convs: list[Conversation]) -> None:
    for conv in convs:  # in order: the first conversation under the system prompt continues its branch
        t = conv.tokens
        res = await client.save(client.prompt(t), len(t), lambda a, b, t=t: kv_payload(ns, t, a, b))
        assert res.stored > 0 and res.rejected == 0 and res.dropped == 0, res


async def measure(client: PrefixClient, ns: Namespace, convs: list[Conversation]) -> list[int]:
    """kv_tokens of every conversation, each byte of it read back and verified (no read misses)."""
    got = []
    for conv in convs:
        res = await client.lookup(conv.tokens)
        assert await read_verified(client, ns, conv.tokens, res) == 0
        await client.release(res.lease_id)
        got.append(res.kv_tokens)
    return got


def clients(ns: Namespace, seeds: list[str]) -> tuple[PrefixClient, PrefixClient]:
    """One client within owner_grace_s of the change it is about to see, one past it."""
    fast = dict(timeout_s=2.0, connect_timeout_s=0.5, retry_after_s=0.05, max_retry_after_s=0.2)
    return (PrefixClient(ns, ClientConfig(urls=tuple(seeds), owner_grace_s=GRACE_S, **fast)),  # type: ignore[arg-type]
            PrefixClient(ns, ClientConfig(urls=tuple(seeds), owner_grace_s=1e-9, **fast)))  # type: ignore[arg-type]


def cluster_of(client: PrefixClient) -> ClusterClient:
    assert isinstance(client.impl, ClusterClient)
    return client.impl


def rolling_restart(cluster: Cluster, nodes: list[str], peers: list[str]) -> None:
    """Restart each node in turn on its LMDB directory with the new member list."""
    for url in nodes:
        assert cluster.procs[url].stop() == 0
        cluster.start_node(url, peers)


def report(what: str, saved: int, *fractions: tuple[str, int]) -> None:
    print(f"\n{what}: {saved} saved tokens; reachable " +
          ", ".join(f"{label} {v / saved:.1%} ({v})" for label, v in fractions))


def test_join_keeps_every_branch_within_grace_and_after_it_loses_only_the_moved_ones(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, *KNOBS)
    old = sorted(cluster.urls)
    new_node = f"http://127.0.0.1:{free_ports(1)[0]}"
    new = sorted([*old, new_node])
    ns = make_namespace(block_tokens=B, with_state=False, model="reach-join")

    async def run() -> None:
        within, after = clients(ns, old)
        async with within, after:
            for c in (within, after):
                await cluster_of(c).membership.refresh()
                assert cluster_of(c).membership.members == tuple(old)
            # A workload where the join moves a fork head and a distinct conversation and keeps
            # the system prompt's branch (the ports are random; the choice is made before the fill).
            for seed in range(1000):
                convs = placed(within, workload(seed), old)
                moved = [b for conv in convs for b in conv.branches if not b.found(new)]
                heads = [b for conv in convs[1:SHARED] for b in conv.branches[1:]]
                if (convs[0].branches[0].found(new)
                        and any(b in moved for b in heads) and any(b not in moved for b in heads)
                        and any(conv.branches[0] in moved for conv in convs[SHARED:])):
                    break
            # Rendezvous: a branch moves only to the new node.
            assert all(rank(new, k)[0] == new_node for b in moved for k in (b.key, b.also) if k is not None)
            await save_all(within, ns, convs)
            saved = sum(len(conv.tokens) for conv in convs)
            assert await measure(within, ns, convs) == [len(conv.tokens) for conv in convs]

            cluster.start_node(new_node, new)  # joins with the new list ...
            rolling_restart(cluster, old, new)  # ... and a rolling restart gives it to the others
            for c in (within, after):
                assert await cluster_of(c).membership.refresh()
                assert cluster_of(c).membership.members == tuple(new) and cluster_of(c).membership.previous == tuple(old)

            got_within = await measure(within, ns, convs)
            got_after = await measure(after, ns, convs)
            predicted = [conv.reachable(lambda b: b.found(new)) for conv in convs]
            report("join 3 -> 4", saved, ("within owner_grace_s", sum(got_within)), ("after it", sum(got_after)),
                   ("predicted after it", sum(predicted)))
            assert got_within == [len(conv.tokens) for conv in convs]  # 100% within the grace window
            assert got_after == predicted  # after it: exactly the conversations cut by a moved branch
            assert 0 < sum(predicted) < saved

            # The new node takes new branches: a conversation whose first block ranks it first lives there.
            fresh = next(t for t in ([50_000_000 + i * 100 + j for j in range(SYSTEM + SUFFIX)] for i in range(1000))
                         if rank(new, after.prompt(t).hashes[0])[0] == new_node)
            await save_all(after, ns, [Conversation(fresh, ())])
            res = await after.lookup(fresh)
            assert res.kv_tokens == len(fresh) and cluster_of(after).last_walk is not None
            assert cluster_of(after).last_walk.nodes == {new_node}  # type: ignore[union-attr]
            assert await read_verified(after, ns, fresh, res) == 0

    asyncio.run(run())


def test_leave_loses_only_the_branches_of_the_removed_node(make_cluster) -> None:  # type: ignore[no-untyped-def]
    cluster = make_cluster(3, *KNOBS)
    old = sorted(cluster.urls)
    ns = make_namespace(block_tokens=B, with_state=False, model="reach-leave")

    async def run() -> None:
        within, after = clients(ns, old)
        async with within, after:
            for c in (within, after):
                await cluster_of(c).membership.refresh()
            # The node to remove holds a fork head and a distinct conversation, not the system prompt.
            gone = None
            for seed in range(1000):
                convs = placed(within, workload(seed), old)
                system_node = convs[0].branches[0].node
                heads = {b.node for conv in convs[1:SHARED] for b in conv.branches[1:]}
                owns = {conv.branches[0].node for conv in convs[SHARED:]}
                gone = next((u for u in old if u != system_node and u in heads and u in owns), None)
                if gone is not None:
                    break
            assert gone is not None
            new = [u for u in old if u != gone]
            await save_all(within, ns, convs)
            saved = sum(len(conv.tokens) for conv in convs)
            assert await measure(within, ns, convs) == [len(conv.tokens) for conv in convs]

            assert cluster.procs[gone].stop() == 0  # the node leaves: its process stopped ...
            rolling_restart(cluster, new, new)  # ... and the list without it rolled out
            for c in (within, after):
                assert await cluster_of(c).membership.refresh()
                assert cluster_of(c).membership.members == tuple(new) and cluster_of(c).membership.previous == tuple(old)

            got_within = await measure(within, ns, convs)
            got_after = await measure(after, ns, convs)
            predicted = [conv.reachable(lambda b: b.node != gone) for conv in convs]
            # Rendezvous: no branch of another node moved.
            assert predicted == [conv.reachable(lambda b: b.found(new)) for conv in convs]
            report("leave 3 -> 2", saved, ("within owner_grace_s", sum(got_within)), ("after it", sum(got_after)),
                   ("predicted", sum(predicted)))
            assert got_within == predicted and got_after == predicted
            assert 0 < sum(predicted) < saved

    asyncio.run(run())
