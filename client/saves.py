"""A cluster save: each item to the home of its level, branch by branch (protocol/placement.py).

The items of one save are a prompt's chain from some level on (blocks, a tail, snapshots). They
start on the home of their first level, whose branch key the lookup before the save learned
(client/walk.py; a save without one walks first). The home decides, at the offer, whether the
first new block continues its parent's branch or forks a new one::

    round 1   offer all items to the home(s) of branch b
              <- want / have / rejected; a fork head: ``fork`` (keep its record here);
                 the items below it: ``elsewhere`` on branch h (the fork head)
              put: payloads of what the home wants, the fork head's record (no payload)
    round 2   offer the fork head (in full) and what hangs below it to the home(s) of branch h
              ...                                           rounds = forks along the saved chain

A snapshot goes with the level of its container (a snapshot in a fork head stays with the
head's record, where every conversation sharing its prefix finds it). With ``replicas`` R > 1
every round offers to the first R live members of the branch in parallel and puts to each what
it wants, with the primary's decisions (so all copies of a branch have the same shape).

A home that cannot be reached drops the items of its round and those below (a dropped save is a
future miss, counted); nothing raises into the engine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.keys import Kind, make_entry_key
from prefixstore.protocol.wire import ItemResult, ItemSpec

from .datapath import Buffer
from .prompt import Prompt
from .results import SaveResult, tally

MAX_ROUNDS = 8
"""Branches one save crosses at most; items further down are dropped (a future miss)."""


@dataclass(frozen=True, slots=True)
class SaveItem:
    spec: ItemSpec
    level: int  # the level it registers under: a block's or tail's parent index, a snapshot's container's
    payload: Callable[[], Buffer]  # made only for what a store wants


def save_items(prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
               snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
               origins: Mapping[int, int] | None = None) -> list[SaveItem]:
    """The items of a save, one way for every client (NodeClient.save, ClusterClient.save): KV
    [start, kv_upto) from the block ``start`` falls in, block by block and a tail, then the snapshots
    by boundary (each in the block, or the tail, whose range holds it); ``origins``: why each
    snapshot was taken (protocol.keys.Origin), 0 where not named."""
    B = prompt.block_tokens
    items = [SaveItem(spec, a // B, functools.partial(kv_payload, a, b))
             for spec, a, b in prompt.kv_items(kv_upto, start - start % B)]
    for t in sorted(snapshots or {}):
        spec = prompt.state_item(t, kv_upto, (origins or {}).get(t, 0))
        block_end = -(-t // B) * B
        level = block_end // B - 1 if block_end <= kv_upto else kv_upto // B
        items.append(SaveItem(spec, level, functools.partial((snapshots or {}).__getitem__, t)))
    return items


class SaveCalls(Protocol):
    """What a cluster save needs of its client (client/cluster.py's ClusterClient is one)."""

    def homes(self, branch: bytes) -> list[str]:
        """Live nodes holding ``branch``, its primary first (at most ``replicas``)."""

    def owner(self, key: bytes) -> str | None:
        """The primary of a branch key, as this client sees the members."""

    async def offer_at(self, url: str, specs: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        """One node's offer decisions (with fork decisions when ``place``)."""

    async def put_at(self, url: str, items: Sequence[tuple[ItemSpec, Buffer]]) -> list[ItemResult]:
        """One node's put results."""

    def learned(self, parent: bytes, branch: bytes) -> None:
        """The level under block ``parent`` is homed on ``branch`` (for later saves)."""


async def save_chain(calls: SaveCalls, items: list[SaveItem], branch: bytes) -> SaveResult:
    """Save ``items`` (chain order) starting on ``branch`` (module docstring)."""
    final: list[ItemResult | None] = [None] * len(items)
    was_put: set[int] = set()
    todo = list(range(len(items)))
    for _ in range(MAX_ROUNDS):
        if not todo:
            break
        homes = calls.homes(branch)
        specs = [dataclasses.replace(items[i].spec, branch=branch) for i in todo]
        offers = list(await asyncio.gather(*(calls.offer_at(url, specs) for url in homes))) if homes else []
        if not offers or all(d.reason is Reason.UNAVAILABLE for d in offers[0]):
            for i in todo:
                final[i] = ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)
            return _result(items, final, was_put)
        decided = dict(zip(todo, offers[0]))
        moved: list[int] = []
        next_branch: bytes | None = None
        head: int | None = None  # the fork head: its record stays here, the block goes to its branch node
        records: list[int] = []
        full: list[int] = []
        gone: set[bytes] = set()  # entry keys of this save's blocks that leave this branch this round
        for i in todo:
            d = decided[i]
            spec = items[i].spec
            key = make_entry_key(spec.kind, spec.hash)
            if follows(spec, gone, items[head].spec if head is not None else None):
                # Its parent (or container) leaves this branch, so it does too, whatever the home
                # answered: an offer longer than a call's items (``max_items``) reaches the home in
                # chunks, and a chunk's items are decided without the chunks before them (the home
                # answered ``want`` under a parent it had just sent elsewhere; left here, the rest
                # of the chain was stored where no walk reaches it).
                moved.append(i)
                gone.add(key)
                continue
            if d.status is ItemStatus.ELSEWHERE:
                moved.append(i)
                gone.add(key)
                next_branch = next_branch or d.branch
            elif d.fork and head is None:
                head, next_branch = i, items[i].spec.hash
                if calls.owner(next_branch) in homes:  # its branch node is this home (1 in N): keep it whole here
                    head = None
                    if d.status is ItemStatus.WANT:
                        full.append(i)
                    else:
                        final[i] = d
                else:
                    gone.add(key)  # the block goes to its branch node (its record stays here)
                    if d.status is ItemStatus.WANT:
                        records.append(i)
            else:
                if d.status is ItemStatus.WANT:
                    full.append(i)
                else:
                    final[i] = d
        if records or full:
            put = await asyncio.gather(*(_put(calls, url, answers, items, todo, records, full, branch, next_branch)
                                         for url, answers in zip(homes, offers)))
            for i, got in put[0].items():
                if i in full:
                    final[i] = got
                    was_put.add(i)
        for i in todo:  # what later saves need: where the level under each stored block lives
            r = final[i]
            if items[i].spec.kind is Kind.BLOCK and r is not None and r.status in (ItemStatus.OK, ItemStatus.HAVE):
                calls.learned(items[i].spec.hash, next_branch if decided[i].fork and next_branch else branch)
        if head is not None:
            calls.learned(items[head].spec.hash, items[head].spec.hash)
            moved = [head] + moved  # the block itself, first of its branch
        if not moved or next_branch is None:
            break
        todo, branch = moved, next_branch
    else:
        for i in todo:
            if final[i] is None:
                final[i] = ItemResult(ItemStatus.DROPPED, Reason.TOO_MANY_FORKS)
    return _result(items, final, was_put)


def follows(spec: ItemSpec, gone: set[bytes], head: ItemSpec | None) -> bool:
    """Whether ``spec`` must leave the branch with an item before it: a block or tail whose parent
    block is ``gone``; a snapshot whose container is, unless the container is the fork ``head``
    (a snapshot in a fork head stays with its record, module docstring)."""
    if spec.kind is Kind.STATE:
        return (spec.container is not None and spec.container in gone
                and (head is None or spec.container != make_entry_key(head.kind, head.hash)))
    return spec.parent is not None and make_entry_key(Kind.BLOCK, spec.parent) in gone


async def _put(calls: SaveCalls, url: str, answers: list[ItemResult], items: list[SaveItem], todo: list[int],
               records: list[int], full: list[int], branch: bytes, head: bytes | None) -> dict[int, ItemResult]:
    """Put to one home what the primary decided, less what this home already has: fork records
    first (a snapshot of this put may hang from one), then payloads."""
    have = {i for i, a in zip(todo, answers) if a.status is ItemStatus.HAVE}
    out: dict[int, ItemResult] = {}
    recs = [i for i in records if i not in have]
    if recs:
        got = await calls.put_at(url, [(dataclasses.replace(items[i].spec, branch=branch, record=True, size=0,
                                                            checksum=None), bytearray()) for i in recs])
        out.update(zip(recs, got))
    whole = [i for i in full if i not in have]
    if whole:
        specs = [dataclasses.replace(items[i].spec, branch=head if items[i].spec.hash == head else branch)
                 for i in whole]
        got = await calls.put_at(url, [(spec, items[i].payload()) for spec, i in zip(specs, whole)])
        out.update(zip(whole, got))
    for i in full:
        out.setdefault(i, ItemResult(ItemStatus.HAVE))
    return out


def _result(items: list[SaveItem], final: list[ItemResult | None], was_put: set[int]) -> SaveResult:
    out = [r if r is not None else ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE) for r in final]
    return tally(out, [(items[i].spec.kind, out[i]) for i in sorted(was_put)], [it.spec.size for it in items])


__all__ = ["MAX_ROUNDS", "SaveCalls", "SaveItem", "follows", "save_chain", "save_items"]
