"""The cluster walk (client/walk.py) against scripted node answers: what it asks, and what it merges."""

from __future__ import annotations

import asyncio

from prefixstore.client import Prompt
from prefixstore.client.walk import Walk
from prefixstore.protocol.hashing import BlockHash
from prefixstore.protocol.probe import ProbeAnswer, ProbeRequest

from ..factories import make_namespace


def test_a_first_hop_cut_at_a_hinted_fork_that_is_held_through_asks_the_rest_of_its_branch() -> None:
    """A hint names level 5 (an earlier walk forked there), so the first hop asks levels 0-5 only and
    the hop at 5 goes out at once. Here the prompt does not fork at 5 any more: the system prompt's
    node holds every block it was asked. The walk must ask that node for levels 6.. (not end the match
    at block 6, nor take the unused early hop's silence for a miss), and leave the early hop over."""
    ns = make_namespace(block_tokens=4, with_state=False)
    p = Prompt(ns, list(range(1, 33)))  # 8 blocks, levels 0-7
    h1, head = p.hashes[0], p.hashes[5]
    asked: list[tuple[bytes, int, int]] = []

    async def hop(branch: bytes, req: ProbeRequest, first: bytes | None) -> list[tuple[str, ProbeAnswer]]:
        asked.append((branch, req.start, req.num_blocks))
        if branch == h1:  # every block asked is stored here in full
            return [("http://sys", ProbeAnswer(start=req.start, held=req.num_blocks))]
        return []  # the old fork head's node: nothing of it

    async def run() -> Walk:
        walk = Walk(p, hop, has_state=False, hints=(5,))
        await walk.run()
        return walk

    walk = asyncio.run(run())
    assert sorted(asked) == sorted([(h1, 0, 6), (head, 5, 3), (h1, 6, 2)]), asked
    assert walk.matched() == 8 and walk.result().kv_tokens == 32 and walk.fork_levels == []
    assert len(walk.leftover()) == 1  # the early hop, for the caller to release


def test_a_prompt_reads_single_hashes_and_runs_of_them_without_the_list() -> None:
    """``hash_at``, ``num_blocks`` and ``hash_run`` (what a walk and its read routes read) say what the
    list of hashes says, and a walk of a prompt never makes that list (it cost a 131,072-token
    cluster lookup about a millisecond)."""
    ns = make_namespace(block_tokens=4, with_state=False)
    p = Prompt(ns, list(range(1, 31)))  # 7 blocks and a tail of 2
    whole = Prompt(ns, list(range(1, 31))).hashes
    assert p.num_blocks == len(whole) == 7
    assert [p.hash_at(j) for j in range(7)] == whole
    run = p.hash_run(5)
    assert len(run) == 5 and list(run) == whole[:5] and run[-1] == whole[4] and run[1:3] == whole[1:3]
    assert [run[j] for j in range(5)] == whole[:5] and list(p.hash_run(0)) == []
    for bad in (lambda: p.hash_at(-1), lambda: p.hash_at(7), lambda: p.hash_run(-1), lambda: p.hash_run(8),
                lambda: run[5]):
        try:
            bad()
        except IndexError:
            continue
        raise AssertionError("out of range, and no IndexError")

    async def hop(branch: bytes, req: ProbeRequest, first: bytes | None) -> list[tuple[str, ProbeAnswer]]:
        return [("http://n", ProbeAnswer(start=req.start, held=req.num_blocks))]

    class NoList(Prompt):
        @property
        def hashes(self) -> list[BlockHash]:
            raise AssertionError("the walk made the list of hashes")

    walk = Walk(NoList(ns, list(range(1, 31))), hop, has_state=False)
    asyncio.run(walk.run())
    assert walk.result().kv_tokens == 28
