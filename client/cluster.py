"""The cluster client: lookups walk the prompt's branches, saves go to each level's home.

``PrefixClient(ns, ClientConfig(urls=(...)))`` uses this class: the same
methods and results as the single-node client (client/client.py ``StoreClient``),
so an engine changes nothing but configuration. It *composes* one
:class:`NodeClient` per member (client/node.py) behind :class:`Node`, the one
per-node call wrapper that counts requests in flight, smooths latency and
opens the node's circuit breaker on failure.

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
choices, fewer requests in flight). A node that errors or times out opens a
circuit breaker (``retry_after_s``, doubling to ``max_retry_after_s``); while
it is open it is skipped (the next member in rendezvous order takes its new
saves; its branches are misses) and then tried again. Within
``owner_grace_s`` of a membership change a hop whose owner moved also asks the
previous owner, so a scale-out does not cut existing branches. Failures never
reach the engine: a miss or a dropped save, counted in ``failures``.

A lookup's lease is one opaque id standing for the leases each node granted
for what it answered; ``release`` releases them all.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import functools
import logging
import math
import os
import random
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from prefixstore.protocol.errors import ItemStatus, Reason, StoreError
from prefixstore.protocol.hashing import root_hash
from prefixstore.protocol.keys import Kind, make_entry_key
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.placement import normalize_url, rank, root_branch
from prefixstore.protocol.probe import LookupReport, ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec
from .config import ClientConfig
from .datapath import Buffer, as_view
from .device import DeviceBuffer
from .failures import Failures
from .node import NodeClient, check_device_outs
from .prompt import Prompt
from .results import LookupResult, SaveResult
from .saves import MAX_ROUNDS, SaveCalls, SaveItem, save_chain
from .walk import Walk

log = logging.getLogger(__name__)

BLOCK_BYTE = bytes((Kind.BLOCK,))  # an entry key is the kind byte and the hash (protocol/keys.py)
MAX_KNOWN_KEYS = 1 << 18
"""Entry keys whose holders the client remembers from lookups (for reads); oldest forgotten first."""
MAX_FORK_HINTS = 1 << 14
"""Prompts' first blocks whose walks' fork levels the client remembers, and fork heads it remembers
(Walk.hints), each."""
MAX_FORK_LEVELS = 4
"""Fork levels remembered per first block (the most recent distinct ones)."""
MAX_UNROUTED = 64
"""Lookups whose block routes wait for a read to be written into the client's route map. A lookup
of the same matched run again replaces its record (an engine's scheduler asks again for a waiting
request every step), so only distinct prompts count against it."""
REPLICA_TTL_S = 5.0
"""How long a replica set learned from an answer is used to spread probes and reads."""

Reader = Callable[[NodeClient, list[GetItem], list[Any]], Awaitable[list[int]]]
"""NodeClient.read or NodeClient.read_device, as one node's client runs it."""
T = TypeVar("T")


class Node:
    """One member, as the cluster client uses it: its node client and the one wrapper every call
    to it goes through (requests in flight, smoothed latency, circuit breaker)."""

    def __init__(self, url: str, client: NodeClient, config: ClientConfig, failures: Failures) -> None:
        self.url = url
        self.client = client
        self._config = config
        self._failures = failures
        self.inflight = 0
        self.latency_s = 0.002  # smoothed (EWMA) latency of its answers
        self.failures_in_row = 0
        self.closed_until = 0.0  # circuit open until then

    def usable(self, now: float) -> bool:
        return self.closed_until <= now

    def succeeded(self, seconds: float) -> None:
        self.failures_in_row = 0
        self.closed_until = 0.0
        self.latency_s += 0.2 * (seconds - self.latency_s)

    def failed(self, op: str, err: BaseException | str) -> None:
        self.failures_in_row += 1
        backoff = min(self._config.max_retry_after_s, self._config.retry_after_s * 2 ** (self.failures_in_row - 1))
        self.closed_until = time.monotonic() + backoff
        self._failures.record(op, f"{self.url}: {err} (skipped for {backoff:g}s)")

    async def run(self, op: str, fn: Callable[[NodeClient], Awaitable[T]],
                  unanswered: Callable[[T], bool] = lambda result: False) -> T | None:
        """Call the node. A StoreError (a node call that raises) or an ``unanswered`` result that
        came with new failures on the node client (an engine-facing call that turned a dead store
        into misses) opens its breaker; None for the former."""
        before = self.client.failures.total()
        self.inflight += 1
        started = time.monotonic()
        try:
            result = await fn(self.client)
        except StoreError as err:
            self.failed(op, err)
            return None
        finally:
            self.inflight -= 1
        if self.client.failures.total() > before and unanswered(result):
            self.failed(op, f"{op} failed")
        else:
            self.succeeded(time.monotonic() - started)
        return result


class ClusterClient(SaveCalls):
    def __init__(self, namespace: Namespace, config: ClientConfig | None = None) -> None:
        config = config or ClientConfig()
        if not config.urls:
            raise ValueError("urls: a cluster client needs at least one seed URL")
        self.namespace = namespace
        self.config = config
        self._failures = Failures(config.warn_interval_s, "prefixstore cluster")
        self._nodes: dict[str, Node] = {}
        self.seeds = tuple(normalize_url(u) for u in config.urls)
        self.members: tuple[str, ...] = self.seeds
        self.previous: tuple[str, ...] = ()
        self.epoch = 0
        self.owner_grace_s = config.owner_grace_s if config.owner_grace_s is not None else 300.0
        self._changed_at = -math.inf
        self._members_at = -math.inf
        self._refresh: asyncio.Task[bool] | None = None
        self._where: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # entry key -> node that answered
        # Routes not yet in _where, in the order learned: (prefix, keys, nodes); entry key = prefix + key.
        # Keyed by what they route -- (True, the run's last block key) for a lookup's matched run (the
        # hash chain makes it name the whole run), (False, entry key) for one entry -- so the same
        # run learned again replaces its record and moves to the end: newest written last, as learned.
        self._unrouted: collections.OrderedDict[tuple[bool, bytes], tuple[bytes, Sequence[bytes], Sequence[str | None]]] \
            = collections.OrderedDict()
        self._replicas: dict[bytes, tuple[float, tuple[str, ...]]] = {}  # entry key -> (until, replica nodes)
        self.replicas = 1  # copies of every branch (the cluster's ``replicas``, from /v1/members)
        self.namespace_root = root_hash(namespace)
        # Learned from walks and saves, oldest forgotten first (MAX_KNOWN_KEYS each):
        self._homes: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # block -> branch of its level
        self._parents: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # entry key -> parent hash
        self._offered: collections.OrderedDict[bytes, tuple[str, ItemSpec]] = collections.OrderedDict()  # raw offers
        # Where walks forked (Walk.hints): h_1 -> levels where walks from it followed a fork, and the
        # blocks they found there as fork heads. A level is a hint for a prompt only where the prompt's
        # own block there is a known head: the conversation that continues on the system prompt's
        # branch shares h_1 and the level with those that fork, not the block.
        self._fork_hints: collections.OrderedDict[bytes, tuple[int, ...]] = collections.OrderedDict()
        self._fork_heads: collections.OrderedDict[bytes, None] = collections.OrderedDict()
        self.last_walk: Walk | None = None  # the last lookup's walk (diagnostics: nodes asked, probes)
        self._leases: dict[bytes, tuple[float, list[tuple[str, bytes]]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._buffers: list[Buffer | DeviceBuffer] = []  # staging buffers registered by the engine (NIXL)
        self.standalone: str | None = None  # the seed that answered, when it is a node of no cluster

    async def __aenter__(self) -> ClusterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return Prompt(self.namespace, tokens, extra_keys)

    # ------------------------------------------------------------ failures and paths: own plus every node's

    @property
    def failures(self) -> collections.Counter[str]:
        total: collections.Counter[str] = collections.Counter(self._failures.counts)
        for node in self._nodes.values():
            total.update(node.client.failures)
        return total

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved, by data path, summed over the nodes."""
        total: collections.Counter[str] = collections.Counter()
        for node in self._nodes.values():
            total.update(node.client.path_bytes)
        return total

    @property
    def data_path(self) -> str:
        """'nixl' when any node's payloads take NIXL, 'http' when they take HTTP, else 'undecided'."""
        paths = {node.client.data_path for node in self._nodes.values()}
        return "nixl" if "nixl" in paths else "http" if "http" in paths else "undecided"

    def nodes(self) -> list[NodeClient]:
        """The node clients met so far (a documented seam: per-node state in tests and diagnostics)."""
        return [node.client for node in self._nodes.values()]

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a staging buffer with every node's data path, now and for nodes met later."""
        if self.config.data_path == "http":
            return False
        self._buffers.append(buf)
        for node in self._nodes.values():
            node.client.register_buffer(buf)
        return True

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        self._buffers = [b for b in self._buffers if b is not buf]
        return any([node.client.unregister_buffer(buf) for node in self._nodes.values()])

    # ------------------------------------------------------------ members and nodes

    def _node(self, url: str) -> Node:
        node = self._nodes.get(url)
        if node is None:
            cfg = dataclasses.replace(self.config, url=url, urls=())
            node = self._nodes[url] = Node(url, NodeClient(self.namespace, cfg), self.config, self._failures)
            for buf in self._buffers:
                node.client.register_buffer(buf)
        return node

    def _usable(self, url: str, now: float) -> bool:
        node = self._nodes.get(url)
        return node is None or node.usable(now)

    def owners(self, key: bytes) -> list[str]:
        """The members in rendezvous order of a placement key (the owner first), as this client sees them."""
        return rank(self.members, key)

    async def refresh_members(self, ask: Sequence[str] | None = None) -> bool:
        """Ask a live member or seed (or the first of ``ask`` that answers) for the member list; True
        when it changed."""
        self._members_at = time.monotonic()
        candidates = list(ask) if ask is not None else list(dict.fromkeys([*self.members, *self.seeds]))
        if ask is None:
            random.shuffle(candidates)
        for url in candidates:
            if not self._usable(url, time.monotonic()):
                continue
            node = self._node(url)
            try:
                body = await node.client.members()
                listed = body["members"]
                if not isinstance(listed, list):
                    raise TypeError("members: expected a list")
                members = tuple(sorted(normalize_url(str(u)) for u in listed))
                grace = body.get("owner_grace_s")
                replicas = body.get("replicas", 1)
            except (StoreError, KeyError, TypeError, ValueError) as err:
                node.failed("members", err)
                continue
            # A plain `prefixstore serve` (no peers) says so, and stays so: PrefixClient then talks to
            # it as a node client, through the URL this client reached it at.
            self.standalone = url if body.get("cluster") is False and len(members) == 1 else None
            if self.config.owner_grace_s is None and isinstance(grace, (int, float)):
                self.owner_grace_s = float(grace)
            if isinstance(replicas, int) and not isinstance(replicas, bool) and replicas >= 1:
                self.replicas = replicas
            if members and members != self.members:
                if self.epoch:  # the first answer replaces the seed list; later ones are changes
                    self.previous = self.members
                    self._changed_at = time.monotonic()
                self.members = members
                self.epoch += 1
                return True
            self.epoch = max(self.epoch, 1)
            return False
        return False

    async def _ensure_members(self) -> None:
        now = time.monotonic()
        if self._members_at == -math.inf:
            await self.refresh_members()
        elif now - self._members_at >= self.config.membership_refresh_s and (
                self._refresh is None or self._refresh.done()):
            self._refresh = asyncio.create_task(self.refresh_members())

    def _in_grace(self) -> bool:
        return bool(self.previous) and time.monotonic() - self._changed_at < self.owner_grace_s

    def _pick(self, candidates: Sequence[str], now: float) -> str | None:
        live = list(dict.fromkeys(u for u in candidates if self._usable(u, now)))
        if len(live) <= 1:
            return live[0] if live else None
        # Two random choices, the one with fewer requests in flight: even when all are idle, steered
        # away from a busy copy. Always taking the least loaded sends a sequential caller's every read
        # to one copy (tests/cluster/test_replication.py caught it); latency is not used because it is
        # measured over every kind of request and puts are slow.
        a, b = random.sample(live, 2)
        return a if self._node(a).inflight <= self._node(b).inflight else b

    def replicas_of(self, key: bytes, now: float | None = None) -> tuple[str, ...]:
        """The nodes holding replicas of an entry, as learned from recent answers (hot prefixes)."""
        now = time.monotonic() if now is None else now
        known = self._replicas.get(key)
        if known is None:
            return ()
        if known[0] < now:
            del self._replicas[key]
            return ()
        return known[1]

    def _routes(self, count: int | None = None) -> None:
        """Write the oldest ``count`` (default: all) lookups' block routes into ``_where``, in order."""
        for _ in range(len(self._unrouted) if count is None else count):
            kind, keys, nodes = self._unrouted.popitem(last=False)[1]
            self._where.update(zip(map(kind.__add__, keys), cast(list[str], nodes)))
        while len(self._where) > MAX_KNOWN_KEYS:
            self._where.popitem(last=False)

    def _queue_routes(self, what: tuple[bool, bytes], routes: tuple[bytes, Sequence[bytes], Sequence[str | None]]) -> None:
        self._unrouted.pop(what, None)
        self._unrouted[what] = routes
        if len(self._unrouted) > MAX_UNROUTED:
            self._routes(1)

    def _remember(self, key: bytes, node: str) -> None:
        if self._unrouted:  # after the routes learned before it, not overwritten by them
            self._queue_routes((False, key), (b"", (key,), (node,)))
            return
        self._where[key] = node
        self._where.move_to_end(key)
        if len(self._where) > MAX_KNOWN_KEYS:
            self._where.popitem(last=False)

    def _spawn(self, coro: Coroutine[object, object, None]) -> None:
        task: asyncio.Task[None] = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def close(self) -> None:
        if self._refresh is not None:
            self._refresh.cancel()
        for task in list(self._background):
            try:
                await asyncio.wait_for(task, self.config.timeout_s)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):
                pass
        for node in self._nodes.values():
            await node.client.close()

    # ------------------------------------------------------------ lookup

    def homes(self, branch: bytes) -> list[str]:
        """The live nodes a branch is placed on: its first ``replicas`` members in rendezvous order
        (the primary first); while all of those are down, the next live member, which takes the
        branch's new saves meanwhile."""
        now = time.monotonic()
        order = rank(self.members, branch)
        live = [u for u in order[: self.replicas] if self._usable(u, now)]
        if not live:
            live = [u for u in order[self.replicas:] if self._usable(u, now)][:1]
        return live

    def owner(self, key: bytes) -> str | None:
        return rank(self.members, key)[0] if self.members else None

    async def _hop(self, branch: bytes, req: ProbeRequest, first: bytes | None,
                   lease: bool, lost: list[str]) -> list[tuple[str, ProbeAnswer]]:
        """One hop of a walk (client/walk.py): a live home of the branch or a node holding copies of
        its first entry, by load; on failure the next one; within owner_grace_s of a change that
        moved the branch, its previous owner too, at the same time. A hop that no home or copy
        answered (all down, their breakers open, or failing now) appends the branch's primary to
        ``lost``: what it holds of the prompt is a miss, and the lookup counts as failed."""
        now = time.monotonic()
        candidates = self.homes(branch)
        holders = set(rank(self.members, branch)[: self.replicas])
        copies = [u for u in self.replicas_of(first, now) if self._usable(u, now)] if first is not None else []
        holders.update(copies)
        extra: list[str] = []
        if self._in_grace():
            before = rank(self.previous, branch)[: self.replicas]
            extra = [u for u in before if u not in candidates and self._usable(u, now)][:1]
        tried: set[str] = set()
        out: list[tuple[str, ProbeAnswer]] = []
        pick = self._pick([*candidates, *copies], now)
        while pick is not None:
            tried.add(pick)
            asked = [pick, *extra]
            extra = []
            got = await asyncio.gather(*(self._node(u).run("probe", lambda c: c.probe(req, lease)) for u in asked))
            out += [(u, a) for u, a in zip(asked, got) if a is not None]
            if got[0] is not None:
                break
            now = time.monotonic()
            pick = self._pick([u for u in [*candidates, *copies] if u not in tried], now) \
                or next(iter(u for u in self.homes(branch) if u not in tried), None)
        for url, answer in out:
            for key, nodes in answer.replicas.items():
                self._replicas[key] = (now + REPLICA_TTL_S, tuple(u for u in nodes if u != url) + (url,))
        if not any(url in holders for url, _ in out):
            lost.append(rank(self.members, branch)[0] if self.members else "no member")
        return out

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """Walk the prompt's branches (client/walk.py); the merged answer is the single-node answer."""
        p = prompt if isinstance(prompt, Prompt) else self.prompt(prompt)
        lease = self.config.lease if lease is None else lease
        await self._ensure_members()
        if not p.num_tokens:
            return LookupResult(prompt=p, ok=bool(self.members))
        if not self.members:
            self._failures.record("lookup", "no seed answered /v1/members")
            return LookupResult(prompt=p, ok=False)
        h1 = p.hashes[0] if p.hashes else None
        n = len(p.hashes)
        levels = self._fork_hints.get(h1, ()) if h1 is not None else ()
        hints = tuple(j for j in levels if j < n and p.hashes[j] in self._fork_heads)
        # Nodes whose part of this prompt went unanswered: one failed lookup, however many hops or
        # breaker-skipped nodes made it so (``failures["probe"]`` counts the node errors themselves).
        lost: list[str] = []
        walk = Walk(p, lambda branch, req, first: self._hop(branch, req, first, lease, lost), self.namespace.has_state,
                    hints=hints)
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
        if h1 is not None:
            self._learn_forks(p, h1, levels, walk)
        return self._merge(p, walk)

    def _learn_forks(self, p: Prompt, h1: bytes, levels: Sequence[int], walk: Walk) -> None:
        """Remember where this walk forked, for the next walk from the same first block (Walk.hints);
        forget a head the walk was hinted and did not follow (the store no longer forks there)."""
        for j in walk.early_levels:
            if j not in walk.fork_levels:
                self._fork_heads.pop(p.hashes[j], None)
        if not walk.fork_levels:
            return
        for j in walk.fork_levels:
            self._fork_heads[p.hashes[j]] = None
            self._fork_heads.move_to_end(p.hashes[j])
        while len(self._fork_heads) > MAX_FORK_HINTS:
            self._fork_heads.popitem(last=False)
        recent = tuple(dict.fromkeys([*walk.fork_levels, *levels]))[:MAX_FORK_LEVELS]
        self._fork_hints[h1] = recent
        self._fork_hints.move_to_end(h1)
        if len(self._fork_hints) > MAX_FORK_HINTS:
            self._fork_hints.popitem(last=False)

    def _merge(self, p: Prompt, walk: Walk) -> LookupResult:
        res = walk.result()  # the one merge (protocol/match.py), as a single node answers
        m = res.matched
        # Where each matched block was found (reads go there, or to a copy): written into _where when
        # a read first needs it (_routes), not here -- 2,048 keys of a 32k-token prompt were a third
        # of a cluster lookup's client time.
        if m:
            self._queue_routes((True, p.hashes[m - 1]), (BLOCK_BYTE, p.hashes[:m], walk.held_at[:m]))  # no None
            self._parent_of_key(BLOCK_BYTE + p.hashes[m - 1], p.parent_of_block(m - 1))
        for j in (m - 1, m):  # where the levels a save continues from live (client/saves.py)
            branch = walk.branch_of[j] if 0 < j < len(walk.branch_of) else None
            if branch is not None:
                self.learned(p.hashes[j - 1], branch)
        child = res.child.entry[0] if res.child is not None else None
        if res.child is not None:
            ref, url = res.child.entry
            self._remember(ref.key, url)
            self._parent_of_key(ref.key, p.parent_of_block(m))
        snapshot = res.snapshot.entry[0] if res.snapshot is not None else None
        if res.snapshot is not None:
            ref, url = res.snapshot.entry
            self._remember(ref.key, url)
        kv, state, hint = res.kv_tokens, res.state_tokens, res.checkpoint_hint
        leases = walk.leases()
        lease_id = None
        if leases:
            lease_id = os.urandom(16)
            self._leases[lease_id] = (time.monotonic() + 3600.0, leases)
            if len(self._leases) > 4096:  # forgotten by an engine that never releases: they expire on the nodes
                now = time.monotonic()
                self._leases = {k: v for k, v in self._leases.items() if v[0] > now}
        ok = bool(walk.answered)
        if ok:
            self._spawn(self._report(p, walk, kv, state, hint, m))
        return LookupResult(prompt=p, kv_tokens=kv, state_tokens=state, checkpoint_hint=hint, matched_blocks=m,
                            child=child, snapshot=snapshot, lease_id=lease_id, ok=ok)

    async def _release_spare(self, spare: list[asyncio.Future[list[tuple[str, ProbeAnswer]]]]) -> None:
        """Release what early hops the walk did not use leased (client/walk.py ``leftover``)."""
        for task in spare:
            try:
                got = await task
            except Exception:  # a hop never raises a store failure; anything else is dropped with it
                continue
            for url, answer in got:
                if answer.lease_id is not None:
                    await self._node(url).client.release(answer.lease_id)

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
                              missing_block=p.hashes[m] if m < len(p.hashes) else None)
        homes = self.homes(branch)
        if homes:
            await self._node(homes[0]).run("lookup_report", lambda c: c.report(report))

    async def release(self, lease_id: bytes | None) -> bool:
        held = self._leases.pop(lease_id, None) if lease_id is not None else None
        if held is None:
            return False
        done = await asyncio.gather(*(self._node(url).client.release(node_lease) for url, node_lease in held[1]))
        return any(done)

    # ------------------------------------------------------------ read

    async def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]:
        """Read each payload from a holder of its entry (by requests in flight); a replica's miss is retried on the node
        that answered the lookup. Per item: bytes written, or -1 for a miss."""
        if len(items) != len(outs):
            raise ValueError("read: one output buffer per item")
        views = [as_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("read: output buffers must be writable")
        return await self._read_routed(items, views, NodeClient.read)

    @property
    def reads_device(self) -> bool:
        return self.config.device_reads and self.config.data_path != "http" and (not self._nodes or any(
            node.client.reads_device for node in self._nodes.values()))

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]:
        """:meth:`NodeClient.read_device` from the holders of each entry, routed as :meth:`read`."""
        check_device_outs(items, outs, self.config)
        return await self._read_routed(items, outs, NodeClient.read_device)

    async def _read_routed(self, items: Sequence[GetItem], views: Sequence[Any], reader: Reader) -> list[int]:
        done = [-1] * len(items)
        now = time.monotonic()
        plan: dict[str, list[int]] = collections.defaultdict(list)
        if self._unrouted:
            self._routes()
        for i, item in enumerate(items):
            home = self._where.get(item.key)
            if home is None:  # never named by a lookup of this client: nowhere to ask
                self._failures.record("read", f"entry {item.key.hex()} was not in a lookup answer")
                continue
            url = self._pick([home, *self.replicas_of(item.key, now)], now)
            if url is not None:
                plan[url].append(i)
        await self._read_from(plan, items, views, done, reader)
        retry: dict[str, list[int]] = collections.defaultdict(list)
        now = time.monotonic()
        for url, idx in plan.items():
            for i in idx:
                home = self._where.get(items[i].key)
                if done[i] < 0 and home is not None and home != url and self._usable(home, now):
                    retry[home].append(i)
        if retry:
            await self._read_from(retry, items, views, done, reader)
        return done

    async def _read_from(self, plan: Mapping[str, list[int]], items: Sequence[GetItem], views: Sequence[Any],
                         done: list[int], reader: Reader) -> None:
        async def one(url: str, idx: list[int]) -> None:
            got = await self._node(url).run("read", lambda c: reader(c, [items[i] for i in idx], [views[i] for i in idx]),
                                            unanswered=lambda sizes: all(g < 0 for g in sizes))
            for i, g in zip(idx, got or []):
                done[i] = g

        await asyncio.gather(*(one(url, idx) for url, idx in plan.items()))

    # ------------------------------------------------------------ write

    def learned(self, parent: bytes, branch: bytes) -> None:
        """The level under block ``parent`` is homed on ``branch`` (learned from walks and saves)."""
        self._homes[bytes(parent)] = branch
        self._homes.move_to_end(bytes(parent))
        if len(self._homes) > MAX_KNOWN_KEYS:
            self._homes.popitem(last=False)

    def _parent_of_key(self, key: bytes, parent: bytes) -> None:
        self._parents[key] = bytes(parent)
        self._parents.move_to_end(key)
        if len(self._parents) > MAX_KNOWN_KEYS:
            self._parents.popitem(last=False)

    def branch_of(self, parent: bytes, tokens: bytes = b"") -> bytes | None:
        """The branch key of the level under ``parent`` (the root level: by the first token), as
        learned; None when this client has not seen it."""
        if parent == self.namespace_root:
            return root_branch(parent, tokens)
        return self._homes.get(bytes(parent))

    def _level_parent(self, spec: ItemSpec, batch: Mapping[bytes, bytes]) -> bytes | None:
        """The parent hash of the level an item registers under (a snapshot: its container's parent)."""
        if spec.kind is Kind.STATE:
            key = spec.container or b""
            return batch.get(key) or self._parents.get(key)
        return spec.parent

    async def offer_at(self, url: str, specs: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        got = await self._node(url).run("save", lambda c: c.offer(specs, place), unanswered=lambda rs: all(
            r.reason is Reason.UNAVAILABLE for r in rs))
        return got if got is not None else [ItemResult(ItemStatus.REJECTED, Reason.UNAVAILABLE)] * len(specs)

    async def put_at(self, url: str, items: Sequence[tuple[ItemSpec, Buffer]]) -> list[ItemResult]:
        got = await self._node(url).run("save", lambda c: c.put(items), unanswered=lambda rs: all(
            r.reason is Reason.UNAVAILABLE for r in rs))
        return got if got is not None else [ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)] * len(items)

    async def _route(self, items: Sequence[ItemSpec]) -> list[tuple[str, ItemSpec] | None]:
        """Each item's home and the item naming its branch (None: this client does not know where
        its level lives: a snapshot of a container it has not seen, a block of a level never
        looked up or saved through it)."""
        await self._ensure_members()
        batch: dict[bytes, bytes] = {}
        out: list[tuple[str, ItemSpec] | None] = []
        for it in items:
            if it.kind is not Kind.STATE:
                assert it.parent is not None
                batch[make_entry_key(it.kind, it.hash)] = bytes(it.parent)
            parent = self._level_parent(it, batch)
            branch = self.branch_of(parent, it.tokens) if parent is not None else None
            homes = self.homes(branch) if branch is not None else []
            out.append((homes[0], dataclasses.replace(it, branch=branch)) if homes else None)
        return out

    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        """want / have / rejected per item, each asked of the home of its level (without fork
        decisions: an engine putting what it was told to keeps its chain on that home). An item
        under a fork record there is asked again of that branch's node."""
        routes = await self._route(items)
        out: list[ItemResult] = [ItemResult(ItemStatus.REJECTED, Reason.PLACEMENT_UNKNOWN)
                                 ] * len(items)
        for _ in range(MAX_ROUNDS):
            groups: dict[str, list[int]] = collections.defaultdict(list)
            for i, r in enumerate(routes):
                if r is not None:
                    groups[r[0]].append(i)
            if not groups:
                break
            answers = await asyncio.gather(*(self.offer_at(url, [routes[i][1] for i in idx], False)  # type: ignore[index]
                                             for url, idx in groups.items()))
            again: list[tuple[str, ItemSpec] | None] = [None] * len(items)
            for (url, idx), got in zip(groups.items(), answers):
                for i, d in zip(idx, got):
                    if d.status is ItemStatus.ELSEWHERE and d.branch is not None and (homes := self.homes(d.branch)):
                        again[i] = (homes[0], dataclasses.replace(routes[i][1], branch=d.branch))  # type: ignore[index]
                        continue
                    out[i] = ItemResult(ItemStatus.WANT, d.reason) if d.fork else d
                    self._offered[make_entry_key(items[i].kind, items[i].hash)] = (url, routes[i][1])  # type: ignore[index]
                    while len(self._offered) > MAX_KNOWN_KEYS:
                        self._offered.popitem(last=False)
            routes = again
        return out

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        """Payloads to the node each item was offered to (else to the home of its level)."""
        routed = await self._route([s for s, _ in items])
        out: list[ItemResult] = [ItemResult(ItemStatus.DROPPED, Reason.PLACEMENT_UNKNOWN)
                                 ] * len(items)
        groups: dict[str, list[tuple[int, ItemSpec]]] = collections.defaultdict(list)
        for i, ((spec, _), r) in enumerate(zip(items, routed)):
            offered = self._offered.pop(make_entry_key(spec.kind, spec.hash), None)
            where = offered or r
            if where is not None:
                groups[where[0]].append((i, dataclasses.replace(spec, branch=where[1].branch)))
        if not groups:
            self._failures.record("save", f"{len(items)} item(s): placement unknown")

        async def one(url: str, idx: list[tuple[int, ItemSpec]]) -> None:
            got = await self._node(url).run("save", lambda c: c.put([(s, items[i][1]) for i, s in idx], commit),
                                            unanswered=lambda rs: all(r.reason is Reason.UNAVAILABLE for r in rs))
            for (i, _), r in zip(idx, got or [ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)] * len(idx)):
                out[i] = r

        await asyncio.gather(*(one(url, idx) for url, idx in groups.items()))
        return out

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
                   origins: Mapping[int, int] | None = None) -> SaveResult:
        """Offer KV [start, kv_upto) and snapshots to the homes of their levels, branch by branch
        (client/saves.py), putting what each home wants. ``origins``: as NodeClient.save."""
        await self._ensure_members()
        B = prompt.block_tokens
        items: list[SaveItem] = []
        for spec, a, b in prompt.kv_items(kv_upto, start - start % B):
            items.append(SaveItem(dataclasses.replace(spec, start=a), a // B, functools.partial(kv_payload, a, b)))
        for t in sorted(snapshots or {}):
            spec = prompt.state_item(t, kv_upto, (origins or {}).get(t, 0))
            block_end = -(-t // B) * B
            container_block = block_end // B - 1 if block_end <= kv_upto else kv_upto // B
            assert spec.container is not None
            self._parent_of_key(spec.container, prompt.parent_of_block(container_block))
            items.append(SaveItem(spec, container_block, functools.partial((snapshots or {}).__getitem__, t)))
        if not items:
            return SaveResult()
        items.sort(key=lambda it: it.level)  # chain order: a round's items hang from its first level
        first = items[0].level
        branch = self.branch_of(prompt.parent_of_block(first), prompt.tokens(first * B, first * B + 1))
        if branch is None:  # never walked here: walk now (no lease), learning where each level lives
            await self.lookup(prompt, lease=False)
            branch = self.branch_of(prompt.parent_of_block(first), prompt.tokens(first * B, first * B + 1))
        if branch is None or not self.members:
            self._failures.record("save", "the prompt's level is not stored anywhere this client can reach")
            return SaveResult(dropped=len(items))
        for it in items:
            if it.spec.kind is not Kind.STATE:
                assert it.spec.parent is not None
                self._parent_of_key(make_entry_key(it.spec.kind, it.spec.hash), it.spec.parent)
        result = await save_chain(self, items, branch)
        if result.dropped:
            self._failures.record("save", f"{result.dropped} item(s) dropped: their home is unavailable")
        return result


__all__ = ["ClusterClient"]
