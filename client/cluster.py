"""The cluster client: lookups walk the prompt's branches, saves go to each level's home.

``PrefixClient(ns, ClientConfig(urls=(...)))`` uses this class: the same
methods and results as the single-node client (client/client.py ``StoreClient``),
so an engine changes nothing but configuration. It *composes*:

* :class:`~prefixstore.client.membership.Membership`: the member list and one
  node client per member behind its breaker (client/membership.py);
* what it learns of where things are, bounded (client/routes.py): read routes,
  save placement, fork hints;
* a walk per lookup (client/walk.py) and a chain of rounds per save (client/saves.py).

Placement (protocol/placement.py): the prefix tree is placed by branches. A
conversation's levels live on one node, conversations spread over the cluster
(each fork head hashes to its own node), and every level has one home that
holds all of it. A lookup (client/walk.py) asks the branch node of the
prompt's first block, which answers every level it is the home of and names
the fork head where the prompt continues: a few hops, one per fork along the
prompt, never all N nodes. A save (client/saves.py) offers its items to the
home of their first level, which decides whether the new blocks continue the
branch or fork a new one on another node.

Which node of a branch: its first ``replicas`` live members in rendezvous order
(the cluster's setting, from ``/v1/members``) and the nodes the client has
learned hold hot copies of the hop's first block, chosen by load (two random
choices, fewer requests in flight). A node behind an open breaker is skipped
(client/membership.py). Within ``owner_grace_s`` of a membership change a hop
whose owner moved also asks the previous owner, so a scale-out does not cut
existing branches. Failures never
reach the engine: a miss or a dropped save, counted in ``failures``.

A lookup's lease is one opaque id standing for the leases each node granted
for what it answered; ``release`` releases them all.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, cast

import numpy as np

from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.hashing import root_hash
from prefixstore.protocol.keys import Kind, make_entry_key
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.probe import LookupReport, ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec

from .config import ClientConfig
from .datapath import Buffer, as_view
from .device import DeviceBuffer
from .failures import Failures
from .lru import BoundedLRU
from .membership import Membership
from .node import NodeClient, check_device_outs
from .prompt import Prompt
from .results import LookupResult, SaveResult
from .routes import ForkHints, Placement, ReadRoutes
from .saves import MAX_ROUNDS, save_chain, save_items
from .walk import Walk

log = logging.getLogger(__name__)

BLOCK_BYTE = bytes((Kind.BLOCK,))  # an entry key is the kind byte and the hash (protocol/keys.py)
MAX_LEASES = 4096
"""Lookup leases this client keeps to release; past it the oldest is forgotten (an engine that never
releases them: a forgotten lease expires on its nodes anyway)."""

Reader = Callable[[NodeClient, list[GetItem], list[Any]], Awaitable[list[int]]]
"""NodeClient.read or NodeClient.read_device, as one node's client runs it."""
Answers = list[tuple[str, ProbeAnswer]]


class ClusterClient:
    def __init__(self, namespace: Namespace, config: ClientConfig | None = None) -> None:
        config = config or ClientConfig()
        if not config.urls:
            raise ValueError("urls: a cluster client needs at least one seed URL")
        self.namespace = namespace
        self.config = config
        self._failures = Failures(config.warn_interval_s, "prefixstore cluster")
        self.membership = Membership(namespace, config, self._failures)
        """The member list and the nodes met (a documented seam: tests change and inspect it)."""
        self.namespace_root = root_hash(namespace)
        self.routes = ReadRoutes()
        self.placement = Placement(self.namespace_root)
        self.forks = ForkHints()
        self.last_walk: Walk | None = None  # the last lookup's walk (diagnostics: nodes asked, probes)
        self._leases: BoundedLRU[bytes, list[tuple[str, bytes]]] = BoundedLRU(MAX_LEASES)  # lookup lease -> node leases
        self._background: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return Prompt(self.namespace, tokens, extra_keys)

    # ------------------------------------------------------------ failures and paths: own plus every node's

    @property
    def failures(self) -> collections.Counter[str]:
        return self.membership.failures(self._failures)

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved, by data path, summed over the nodes."""
        return self.membership.path_bytes()

    @property
    def data_path(self) -> str:
        """'nixl' when any node's payloads take NIXL, 'http' when they take HTTP, else 'undecided'."""
        paths = {node.client.data_path for node in self.membership.nodes()}
        return "nixl" if "nixl" in paths else "http" if "http" in paths else "undecided"

    def nodes(self) -> list[NodeClient]:
        """The node clients met so far (a documented seam: per-node state in tests and diagnostics)."""
        return [node.client for node in self.membership.nodes()]

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a staging buffer with every node's data path, now and for nodes met later."""
        if self.config.data_path == "http":
            return False
        self.membership.register_buffer(buf)
        return True

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        return self.membership.unregister_buffer(buf)

    def replicas_of(self, key: bytes, now: float | None = None) -> tuple[str, ...]:
        """The nodes holding replicas of an entry, as learned from recent answers (hot prefixes)."""
        return self.routes.replicas_of(key, now)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        for task in list(self._background):
            try:
                await asyncio.wait_for(task, self.config.timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass
        await self.membership.close()

    # ------------------------------------------------------------ placement (saves.SaveCalls)

    def homes(self, branch: bytes) -> list[str]:
        """The live nodes a branch is placed on (Membership.homes)."""
        return self.membership.homes(branch)

    def owner(self, key: bytes) -> str | None:
        return self.membership.owner(key)

    def learned(self, parent: bytes, branch: bytes) -> None:
        """The level under block ``parent`` is homed on ``branch`` (learned from walks and saves)."""
        self.placement.learned(parent, branch)

    # ------------------------------------------------------------ lookup

    async def _hop(self, branch: bytes, req: ProbeRequest, first: bytes | None,
                   lease: bool, lost: list[str]) -> Answers:
        """One hop of a walk (client/walk.py): a live home of the branch or a node holding copies of
        its first entry, by load; on failure the next one; within owner_grace_s of a change that
        moved the branch, its previous owner too, at the same time. A hop that no home or copy
        answered (all down, their breakers open, or failing now) appends the branch's primary to
        ``lost``: what it holds of the prompt is a miss, and the lookup counts as failed."""
        members = self.membership
        now = time.monotonic()
        candidates = members.homes(branch)
        holders = set(members.holders(branch))
        copies = [u for u in self.routes.replicas_of(first, now) if members.usable(u, now)] if first is not None else []
        holders.update(copies)
        extra: list[str] = []
        if members.in_grace():
            extra = [u for u in members.previous_holders(branch) if u not in candidates and members.usable(u, now)][:1]
        tried: set[str] = set()
        out: Answers = []
        pick = members.pick([*candidates, *copies], now)
        while pick is not None:
            tried.add(pick)
            asked = [pick, *extra]
            extra = []
            got = await asyncio.gather(*(members.node(u).run("probe", lambda c: c.probe(req, lease)) for u in asked))
            out += [(u, a) for u, a in zip(asked, got) if a is not None]
            if got[0] is not None:
                break
            now = time.monotonic()
            pick = members.pick([u for u in [*candidates, *copies] if u not in tried], now) \
                or next(iter(u for u in members.homes(branch) if u not in tried), None)
        for url, answer in out:
            self.routes.learn_replicas(url, answer.replicas, now)
        if not any(url in holders for url, _ in out):
            lost.append(members.owner(branch) or "no member")
        return out

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """Walk the prompt's branches (client/walk.py); the merged answer is the single-node answer."""
        p = prompt if isinstance(prompt, Prompt) else self.prompt(prompt)
        lease = self.config.lease if lease is None else lease
        await self.membership.ensure()
        if not p.num_tokens:
            return LookupResult(prompt=p, ok=bool(self.membership.members))
        if not self.membership.members:
            self._failures.record("lookup", "no seed answered /v1/members")
            return LookupResult(prompt=p, ok=False)
        levels = self.forks.levels(p)
        # Nodes whose part of this prompt went unanswered: one failed lookup, however many hops or
        # breaker-skipped nodes made it so (``failures["probe"]`` counts the node errors themselves).
        lost: list[str] = []
        walk = Walk(p, lambda branch, req, first: self._hop(branch, req, first, lease, lost), self.namespace.has_state,
                    hints=self.forks.hints(p, levels))
        try:
            await walk.run()
        finally:
            spare = walk.leftover()
            if spare:
                self._spawn(self._release_spare(spare))
            if lost:
                nodes = ", ".join(sorted(set(lost)))
                self._failures.record("lookup", f"no live node holding its branch answered ({nodes})")
        self.last_walk = walk
        if p.num_blocks:
            self.forks.learn(p, levels, walk.early_levels, walk.fork_levels)
        return self._answer(p, walk)

    def _answer(self, p: Prompt, walk: Walk) -> LookupResult:
        """The walk's merged answer (protocol/match.py) as a lookup result; what it taught remembered."""
        res = walk.result()
        m = res.matched
        if m:  # where each matched block was found: reads go there, or to a copy (ReadRoutes)
            self.routes.run(BLOCK_BYTE, p.hash_run(m), cast(list[str], walk.held_at[:m]))  # below m, none is None
            self.placement.parent_of(BLOCK_BYTE + p.hash_at(m - 1), p.parent_of_block(m - 1))
        for j in (m - 1, m):  # where the levels a save continues from live (client/saves.py)
            branch = walk.branch_of[j] if 0 < j < len(walk.branch_of) else None
            if branch is not None:
                self.placement.learned(p.hash_at(j - 1), branch)
        child = snapshot = None
        if res.child is not None:
            child, url = res.child.entry
            self.routes.remember(child.key, url)
            self.placement.parent_of(child.key, p.parent_of_block(m))
        if res.snapshot is not None:
            snapshot, url = res.snapshot.entry
            self.routes.remember(snapshot.key, url)
        lease_id = None
        leases = walk.leases()
        if leases:
            lease_id = os.urandom(16)
            self._leases.put(lease_id, leases)
        ok = bool(walk.answered)
        if ok:
            self._spawn(self._report(p, walk, res.kv_tokens, res.state_tokens, res.checkpoint_hint, m))
        return LookupResult(prompt=p, kv_tokens=res.kv_tokens, state_tokens=res.state_tokens,
                            checkpoint_hint=res.checkpoint_hint, matched_blocks=m, child=child, snapshot=snapshot,
                            lease_id=lease_id, ok=ok)

    async def _release_spare(self, spare: list[asyncio.Future[Answers]]) -> None:
        """Release what early hops the walk did not use leased (client/walk.py ``leftover``)."""
        for task in spare:
            try:
                got = await task
            except Exception:  # a hop never raises a store failure; anything else is dropped with it
                continue
            for url, answer in got:
                if answer.lease_id is not None:
                    await self.membership.node(url).client.release(answer.lease_id)

    async def _report(self, p: Prompt, walk: Walk, kv: int, state: int, hint: int, m: int) -> None:
        """Tell the junction's home what a single node would have counted (policies, metrics)."""
        B = p.block_tokens
        junction = p.prefix_hash(hint) if hint else None
        # A snapshot at kv would register in the entry ending there: its level is that entry's parent's.
        level = (kv - 1) // B if kv else 0
        branch = walk.branch_of[level] if level < len(walk.branch_of) else None
        if branch is None:
            return
        report = LookupReport(namespace_id=self.namespace.id, num_tokens=p.num_tokens, kv_tokens=kv,
                              state_tokens=state, junction=junction,
                              missing_block=p.hash_at(m) if m < p.num_blocks else None)
        homes = self.membership.homes(branch)
        if homes:
            await self.membership.node(homes[0]).run("lookup_report", lambda c: c.report(report))

    async def release(self, lease_id: bytes | None) -> bool:
        held = self._leases.pop(lease_id, None) if lease_id is not None else None
        if held is None:
            return False
        done = await asyncio.gather(*(self.membership.node(url).client.release(node_lease)
                                      for url, node_lease in held))
        return any(done)

    # ------------------------------------------------------------ read

    async def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]:
        """Read each payload from a holder of its entry (by requests in flight); a replica's miss is
        retried on the node that answered the lookup. Per item: bytes written, or -1 for a miss."""
        if len(items) != len(outs):
            raise ValueError("read: one output buffer per item")
        views = [as_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("read: output buffers must be writable")
        return await self._read_routed(items, views, NodeClient.read)

    @property
    def reads_device(self) -> bool:
        nodes = self.membership.nodes()
        return self.config.device_reads and self.config.data_path != "http" and (not nodes or any(
            node.client.reads_device for node in nodes))

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]:
        """:meth:`NodeClient.read_device` from the holders of each entry, routed as :meth:`read`."""
        check_device_outs(items, outs, self.config)
        return await self._read_routed(items, outs, NodeClient.read_device)

    async def _read_routed(self, items: Sequence[GetItem], views: Sequence[Any], reader: Reader) -> list[int]:
        done = [-1] * len(items)
        members = self.membership
        now = time.monotonic()
        plan: dict[str, list[int]] = collections.defaultdict(list)
        for i, item in enumerate(items):
            home = self.routes.holder(item.key)
            if home is None:  # never named by a lookup of this client: nowhere to ask
                self._failures.record("read", f"entry {item.key.hex()} was not in a lookup answer")
                continue
            url = members.pick([home, *self.routes.replicas_of(item.key, now)], now)
            if url is not None:
                plan[url].append(i)
        await self._read_from(plan, items, views, done, reader)
        retry: dict[str, list[int]] = collections.defaultdict(list)
        now = time.monotonic()
        for url, idx in plan.items():
            for i in idx:
                home = self.routes.holder(items[i].key)
                if done[i] < 0 and home is not None and home != url and members.usable(home, now):
                    retry[home].append(i)
        if retry:
            await self._read_from(retry, items, views, done, reader)
        return done

    async def _read_from(self, plan: Mapping[str, list[int]], items: Sequence[GetItem], views: Sequence[Any],
                         done: list[int], reader: Reader) -> None:
        async def one(url: str, idx: list[int]) -> None:
            got = await self.membership.node(url).run(
                "read", lambda c: reader(c, [items[i] for i in idx], [views[i] for i in idx]),
                unanswered=lambda sizes: all(g < 0 for g in sizes))
            for i, g in zip(idx, got or []):
                done[i] = g

        await asyncio.gather(*(one(url, idx) for url, idx in plan.items()))

    # ------------------------------------------------------------ write

    async def offer_at(self, url: str, specs: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        got = await self.membership.node(url).run("save", lambda c: c.offer(specs, place), unanswered=lambda rs: all(
            r.reason is Reason.UNAVAILABLE for r in rs))
        return got if got is not None else [ItemResult(ItemStatus.REJECTED, Reason.UNAVAILABLE)] * len(specs)

    async def put_at(self, url: str, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True
                     ) -> list[ItemResult]:
        got = await self.membership.node(url).run("save", lambda c: c.put(items, commit), unanswered=lambda rs: all(
            r.reason is Reason.UNAVAILABLE for r in rs))
        return got if got is not None else [ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)] * len(items)

    async def _route(self, items: Sequence[ItemSpec]) -> list[tuple[str, ItemSpec] | None]:
        """Each item's home and the item naming its branch (None: this client does not know where
        its level lives: a snapshot of a container it has not seen, a block of a level never
        looked up or saved through it)."""
        await self.membership.ensure()
        batch: dict[bytes, bytes] = {}
        out: list[tuple[str, ItemSpec] | None] = []
        for it in items:
            if it.kind is not Kind.STATE:
                assert it.parent is not None
                batch[make_entry_key(it.kind, it.hash)] = bytes(it.parent)
            parent = self.placement.level_parent(it, batch)
            branch = self.placement.branch_of(parent, it.tokens) if parent is not None else None
            homes = self.membership.homes(branch) if branch is not None else []
            out.append((homes[0], dataclasses.replace(it, branch=branch)) if homes else None)
        return out

    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        """want / have / rejected per item, each asked of the home of its level (without fork
        decisions: an engine putting what it was told to keeps its chain on that home). An item
        under a fork record there is asked again of that branch's node."""
        routes = await self._route(items)
        out = [ItemResult(ItemStatus.REJECTED, Reason.PLACEMENT_UNKNOWN)] * len(items)
        for _ in range(MAX_ROUNDS):
            groups: dict[str, list[tuple[int, ItemSpec]]] = collections.defaultdict(list)
            for i, r in enumerate(routes):
                if r is not None:
                    groups[r[0]].append((i, r[1]))
            if not groups:
                break
            answers = await asyncio.gather(*(self.offer_at(url, [spec for _, spec in idx], False)
                                             for url, idx in groups.items()))
            again: list[tuple[str, ItemSpec] | None] = [None] * len(items)
            for (url, idx), got in zip(groups.items(), answers):
                for (i, spec), d in zip(idx, got):
                    if d.status is ItemStatus.ELSEWHERE and d.branch is not None and (homes := self.homes(d.branch)):
                        again[i] = (homes[0], dataclasses.replace(spec, branch=d.branch))
                        continue
                    out[i] = ItemResult(ItemStatus.WANT, d.reason) if d.fork else d
                    self.placement.offered(make_entry_key(items[i].kind, items[i].hash), url, spec)
            routes = again
        return out

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        """Payloads to the node each item was offered to (else to the home of its level)."""
        routed = await self._route([s for s, _ in items])
        out = [ItemResult(ItemStatus.DROPPED, Reason.PLACEMENT_UNKNOWN)] * len(items)
        groups: dict[str, list[tuple[int, ItemSpec]]] = collections.defaultdict(list)
        for i, ((spec, _), r) in enumerate(zip(items, routed)):
            where = self.placement.take_offer(make_entry_key(spec.kind, spec.hash)) or r
            if where is not None:
                groups[where[0]].append((i, dataclasses.replace(spec, branch=where[1].branch)))
        if not groups:
            self._failures.record("save", f"{len(items)} item(s): placement unknown")

        async def one(url: str, idx: list[tuple[int, ItemSpec]]) -> None:
            for (i, _), r in zip(idx, await self.put_at(url, [(s, items[i][1]) for i, s in idx], commit)):
                out[i] = r

        await asyncio.gather(*(one(url, idx) for url, idx in groups.items()))
        return out

    async def prepare(self) -> bool:
        """Every member's data path set up ahead of the first transfer (PrefixClient.prepare):
        whether any member's payloads will take NIXL. The metadata is asked of every member at
        once, but each node client makes its own agent, one after another on this loop (about
        0.4 s each here): a start-up cost that grows with the cluster. Members that join later set
        theirs up at their first transfer."""
        await self.membership.ensure()
        ready = await asyncio.gather(*(self.membership.node(url).client.prepare() for url in self.membership.members))
        return any(ready)

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
                   origins: Mapping[int, int] | None = None) -> SaveResult:
        """Offer KV [start, kv_upto) and snapshots to the homes of their levels, branch by branch
        (client/saves.py), putting what each home wants. ``origins``: as NodeClient.save."""
        await self.membership.ensure()
        B = prompt.block_tokens
        items = save_items(prompt, kv_upto, kv_payload, snapshots, start, origins)
        if not items:
            return SaveResult()
        for n, it in enumerate(items):
            if it.spec.kind is Kind.STATE:  # its level is its container's
                assert it.spec.container is not None
                self.placement.parent_of(it.spec.container, prompt.parent_of_block(it.level))
            else:  # where the block starts: its parent may be another node's (store/writes.py)
                items[n] = dataclasses.replace(it, spec=dataclasses.replace(it.spec, start=it.level * B))
        items.sort(key=lambda it: it.level)  # chain order: a round's items hang from its first level
        first = items[0].level
        branch = self.placement.branch_of(prompt.parent_of_block(first), prompt.tokens(first * B, first * B + 1))
        if branch is None:  # never walked here: walk now (no lease), learning where each level lives
            await self.lookup(prompt, lease=False)
            branch = self.placement.branch_of(prompt.parent_of_block(first), prompt.tokens(first * B, first * B + 1))
        if branch is None or not self.membership.members:
            self._failures.record("save", "the prompt's level is not stored anywhere this client can reach")
            return SaveResult(dropped=len(items))
        for it in items:
            if it.spec.kind is not Kind.STATE:
                assert it.spec.parent is not None
                self.placement.parent_of(make_entry_key(it.spec.kind, it.spec.hash), it.spec.parent)
        result = await save_chain(self, items, branch)
        if result.dropped:
            self._failures.record("save", f"{result.dropped} item(s) dropped: their home is unavailable")
        return result


__all__ = ["ClusterClient"]
