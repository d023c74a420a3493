"""The cluster client: one lookup fans out to the nodes that own the prompt's levels, in parallel.

``PrefixClient(ns, ClientConfig(urls=(...)))`` uses this class: the same
methods and results as the single-node client (client/client.py ``StoreClient``),
so an engine changes nothing but configuration. It *composes* one
:class:`NodeClient` per member (client/node.py) behind :class:`Node`, the one
per-node call wrapper that counts requests in flight, smooths latency and
opens the node's circuit breaker on failure.

Placement (protocol/placement.py): level j of a prompt (parent hash h_j, h_0
the root, and the prompt's token at jB) lives on the first member in
rendezvous order of that level key, which holds the children of h_j starting
with that token (the prompt's next block h_{j+1}, other blocks and tails) and
the snapshots registered in them. A lookup::

    levels 0..n ──group by owner──►  node A: levels {0, 3, 4}   node B: {1}   node C: {2, 5}
                                        │ POST /v1/probe, all at once, each under timeout_s
                                        ▼
    merge: m = first level whose next block is not held;  kv = m·B + usable tokens of level m's child;
           state = best snapshot of levels 0..m (boundary <= kv)            == the single-node answer

A level is asked of a node holding a replica of its next block when the
client knows one (hot prefixes, learned from earlier answers), chosen by
load (two random choices, fewer requests in flight). When the level that ends
the match was answered by a replica, or (for ``owner_grace_s`` after a
membership change) its owner changed, it is asked again of its owner or
previous owner: at most a few follow-ups, only on those paths.

Failures never reach the engine: a node that errors or times out opens a
circuit breaker (``retry_after_s``, doubling to ``max_retry_after_s``); while
it is open the node's levels are misses and saves to it are dropped, then it
is tried again. Saves go to each item's owner. Reads go to a holder of each
entry (the node that answered for it, or a replica), a miss on a replica
retried once on the node that answered.

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
from typing import Any, TypeVar

import numpy as np

from ..protocol.errors import ItemStatus, StoreError
from ..protocol.hashing import BlockHash
from ..protocol.keys import Kind, make_entry_key
from ..protocol.namespace import Namespace
from ..protocol.placement import level_key, normalize_url, rank
from ..protocol.probe import LevelAnswer, LookupReport, ProbeAnswer, ProbeLevel
from ..protocol.wire import EntryRef, GetItem, ItemResult, ItemSpec
from .config import ClientConfig
from .datapath import Buffer, as_view
from .device import DeviceBuffer
from .failures import Failures
from .node import NodeClient, check_device_outs
from .prompt import Prompt
from .results import LookupResult, SaveResult

log = logging.getLogger(__name__)

MAX_KNOWN_KEYS = 1 << 18
"""Entry keys whose holders the client remembers from lookups (for reads); oldest forgotten first."""
REPLICA_TTL_S = 5.0
"""How long a replica set learned from an answer is used to spread probes and reads."""
MAX_FOLLOW_UPS = 3

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


class ClusterClient:
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
        self._replicas: dict[bytes, tuple[float, tuple[str, ...]]] = {}  # entry key -> (until, replica nodes)
        self._level_of: collections.OrderedDict[bytes, bytes] = collections.OrderedDict()  # container key -> level key
        self._leases: dict[bytes, tuple[float, list[tuple[str, bytes]]]] = {}
        self._background: set[asyncio.Task[None]] = set()
        self._buffers: list[Buffer | DeviceBuffer] = []  # staging buffers registered by the engine (NIXL)

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
            except (StoreError, KeyError, TypeError, ValueError) as err:
                node.failed("members", err)
                continue
            if self.config.owner_grace_s is None and isinstance(grace, (int, float)):
                self.owner_grace_s = float(grace)
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

    def _remember(self, key: bytes, node: str) -> None:
        self._where[key] = node
        self._where.move_to_end(key)
        if len(self._where) > MAX_KNOWN_KEYS:
            self._where.popitem(last=False)

    def _remember_level(self, container: bytes, level: bytes) -> None:
        self._level_of[container] = level
        self._level_of.move_to_end(container)
        if len(self._level_of) > MAX_KNOWN_KEYS:
            self._level_of.popitem(last=False)

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

    async def _probe(self, url: str, levels: list[ProbeLevel], lease: bool) -> tuple[str, ProbeAnswer | None]:
        # On the NIXL path the node also places the payloads it reports (store/nixl_lookup.py):
        # the node's client then reads them with one READ, as after a single node's lookup.
        return url, await self._node(url).run("lookup", lambda c: c.probe(levels, lease))

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """One parallel round trip to the owners of the prompt's levels, merged into the single-node answer."""
        p = prompt if isinstance(prompt, Prompt) else self.prompt(prompt)
        lease = self.config.lease if lease is None else lease
        await self._ensure_members()
        B, n, T = p.block_tokens, len(p.hashes), p.num_tokens
        levels: list[ProbeLevel] = []
        for j in range(n + 1):
            seg = p.tokens(j * B, min((j + 1) * B, T))
            if j == n and not seg:
                break
            levels.append(ProbeLevel(level=j, parent=p.parent_of_block(j), next=p.hashes[j] if j < n else b"",
                                     tokens=seg, extra=p.extra_keys[j] if j < len(p.extra_keys) else b""))
        if not levels or not self.members:
            return LookupResult(prompt=p, ok=bool(self.members))
        now = time.monotonic()
        asked: dict[int, set[str]] = collections.defaultdict(set)
        plan: dict[str, list[ProbeLevel]] = collections.defaultdict(list)
        for lv in levels:
            order = rank(self.members, level_key(lv.parent, lv.tokens))
            candidates = [order[0], *self.replicas_of(make_entry_key(Kind.BLOCK, BlockHash(lv.next)), now)] \
                if lv.next else [order[0]]
            url = self._pick(candidates, now)
            if url is not None:  # None: the owner's circuit is open: this level is a miss
                plan[url].append(lv)
                asked[lv.level].add(url)
        answers: dict[int, LevelAnswer] = {}
        found: dict[object, str] = {}  # level (held next block) or entry key -> the node that reported it
        leases: list[tuple[str, bytes]] = []
        num_ok = await self._gather(plan, lease, answers, found, leases)
        # Follow-ups: the level that ends the match, asked again where a better answer may be.
        for _ in range(MAX_FOLLOW_UPS):
            m = _matched(answers, n)
            retry: dict[str, list[ProbeLevel]] = collections.defaultdict(list)
            now = time.monotonic()
            for lv in levels[m:]:
                extra = []
                if lv.level == m:
                    extra.append(rank(self.members, level_key(lv.parent, lv.tokens))[0])  # a replica missed
                if self._in_grace():
                    extra.append(rank(self.previous, level_key(lv.parent, lv.tokens))[0])  # owner before
                for url in extra:
                    if url not in asked[lv.level] and self._usable(url, now):
                        retry[url].append(lv)
                        asked[lv.level].add(url)
            if not retry:
                break
            num_ok += await self._gather(retry, lease, answers, found, leases)
        return self._merge(p, levels, answers, found, leases, ok=num_ok > 0)

    async def _gather(self, plan: Mapping[str, list[ProbeLevel]], lease: bool, answers: dict[int, LevelAnswer],
                      found: dict[object, str], leases: list[tuple[str, bytes]]) -> int:
        results = await asyncio.gather(*(self._probe(url, lvs, lease) for url, lvs in plan.items()))
        now = time.monotonic()
        ok = 0
        for url, answer in results:
            if answer is None:
                continue
            ok += 1
            if answer.lease_id is not None:
                leases.append((url, answer.lease_id))
            for key, nodes in answer.replicas.items():
                self._replicas[key] = (now + REPLICA_TTL_S, tuple(u for u in nodes if u != url) + (url,))
            for la in answer.levels:
                old = answers.get(la.level)
                answers[la.level] = _better(old, la) if old else la
                if la.held:
                    found.setdefault(la.level, url)
                for ref in (la.child, la.snapshot):
                    if ref is not None:
                        found.setdefault(ref.key, url)
        return ok

    def _merge(self, p: Prompt, levels: list[ProbeLevel], answers: dict[int, LevelAnswer],
               found: dict[object, str], leases: list[tuple[str, bytes]], ok: bool) -> LookupResult:
        B, n = p.block_tokens, len(p.hashes)
        m = _matched(answers, n)
        for j in range(m):  # where each matched block was found: reads go there (or to a replica)
            self._remember(p.block_key(j), found[j])
        child: EntryRef | None = None
        kv = m * B
        at_m = answers.get(m)
        if at_m is not None and not at_m.held and at_m.child is not None:
            child = at_m.child
            kv += child.usable_tokens
            self._remember(child.key, found[child.key])
        snapshot: EntryRef | None = None
        for j in range(min(m, len(levels) - 1), -1, -1):
            got = answers.get(j)
            if got is None or got.snapshot is None:
                continue
            s = got.snapshot
            if s.usable_tokens <= kv and (snapshot is None or s.usable_tokens > snapshot.usable_tokens):
                snapshot = s
        if snapshot is not None:
            self._remember(snapshot.key, found[snapshot.key])
        state = snapshot.usable_tokens if snapshot is not None else 0
        hint = kv if self.namespace.has_state and kv > state else 0
        lease_id = None
        if leases:
            lease_id = os.urandom(16)
            self._leases[lease_id] = (time.monotonic() + 3600.0, leases)
            if len(self._leases) > 4096:  # forgotten by an engine that never releases: they expire on the nodes
                now = time.monotonic()
                self._leases = {k: v for k, v in self._leases.items() if v[0] > now}
        if ok:
            self._spawn(self._report(p, kv, state, hint, m))
        return LookupResult(prompt=p, kv_tokens=kv, state_tokens=state, checkpoint_hint=hint, matched_blocks=m,
                            child=child, snapshot=snapshot, lease_id=lease_id, ok=ok)

    async def _report(self, p: Prompt, kv: int, state: int, hint: int, m: int) -> None:
        """Tell the junction's owner what a single node would have counted (policies, metrics)."""
        B = p.block_tokens
        junction = p.prefix_hash(hint) if hint else None
        # The snapshot at kv would register in the entry ending there: its level is that entry's parent.
        start = (kv - 1) // B * B if kv else 0
        level = level_key(p.parent_of_block(start // B), p.tokens(start, start + 1))
        report = LookupReport(namespace_id=self.namespace.id, num_tokens=p.num_tokens, kv_tokens=kv,
                              state_tokens=state, junction=junction,
                              missing_block=p.hashes[m] if m < len(p.hashes) else None)
        url = rank(self.members, level)[0]
        if self._usable(url, time.monotonic()):
            await self._node(url).run("lookup_report", lambda c: c.report(report))

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

    def _route(self, items: Sequence[ItemSpec]) -> list[str | None]:
        """Each item's owner: the owner of the hash it registers under (None: unknown, for a snapshot
        whose container this client has not seen)."""
        levels: dict[bytes, bytes] = {}
        out: list[str | None] = []
        for it in items:
            if it.kind is Kind.STATE:
                level = levels.get(it.container or b"") or self._level_of.get(it.container or b"")
            else:
                assert it.parent is not None
                level = level_key(it.parent, it.tokens)
                levels[make_entry_key(it.kind, it.hash)] = level
            out.append(rank(self.members, level)[0] if level is not None and self.members else None)
        return out

    async def _per_node(self, items: Sequence[ItemSpec],
                        call: Callable[[NodeClient, list[int]], Awaitable[list[ItemResult]]],
                        unavailable: ItemResult) -> list[ItemResult]:
        await self._ensure_members()
        owners = self._route(items)
        out: list[ItemResult] = [unavailable] * len(items)
        groups: dict[str, list[int]] = collections.defaultdict(list)
        now = time.monotonic()
        for i, url in enumerate(owners):
            if url is not None and self._usable(url, now):
                groups[url].append(i)
        dropped = len(items) - sum(len(g) for g in groups.values())
        if dropped:
            self._failures.record("save", f"{dropped} item(s): owner unavailable or unknown")

        async def one(url: str, idx: list[int]) -> None:
            results = await self._node(url).run("save", lambda c: call(c, idx), unanswered=lambda rs: all(
                r.reason == "store unavailable" for r in rs))
            for i, r in zip(idx, results or []):
                out[i] = r

        await asyncio.gather(*(one(url, idx) for url, idx in groups.items()))
        return out

    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        """want / have / rejected per item, each asked of its owner."""
        return await self._per_node(items, lambda c, idx: c.offer([items[i] for i in idx]),
                                    ItemResult(ItemStatus.REJECTED, "store unavailable"))

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        """Payloads to each item's owner. Blocks and tails need ``ItemSpec.start`` in a cluster
        (``save`` sets it); their parent usually lives on another node."""
        specs = [s for s, _ in items]
        return await self._per_node(specs, lambda c, idx: c.put([items[i] for i in idx], commit),
                                    ItemResult(ItemStatus.DROPPED, "store unavailable"))

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0) -> SaveResult:
        """Offer KV [start, kv_upto) and snapshots to their owners, then put what each wants.

        Nodes work in parallel: a block's parent lives elsewhere anyway (each node takes a block whose
        parent it does not hold, with its start); a snapshot goes to the node of its container."""
        B = prompt.block_tokens
        kv = prompt.kv_items(kv_upto, start - start % B)
        specs: list[ItemSpec] = [dataclasses.replace(spec, start=a) for spec, a, _ in kv]
        payload_of: list[Callable[[], Buffer]] = [functools.partial(kv_payload, a, b) for _, a, b in kv]
        for t in sorted(snapshots or {}):
            spec = prompt.state_item(t, kv_upto)
            block_end = -(-t // B) * B
            container_block = block_end // B - 1 if block_end <= kv_upto else kv_upto // B
            assert spec.container is not None
            self._remember_level(spec.container, level_key(prompt.parent_of_block(container_block),
                                                           prompt.tokens(container_block * B, container_block * B + 1)))
            specs.append(spec)
            payload_of.append(functools.partial((snapshots or {}).__getitem__, t))
        decisions = await self.offer(specs)
        wanted = [i for i, d in enumerate(decisions) if d.status is ItemStatus.WANT]
        results = await self.put([(specs[i], payload_of[i]()) for i in wanted]) if wanted else []
        stored = sum(r.status is ItemStatus.OK for r in results)
        have = sum(d.status is ItemStatus.HAVE for d in decisions) + sum(r.status is ItemStatus.HAVE for r in results)
        dropped = sum(d.reason == "store unavailable" for d in decisions) + sum(
            r.status is ItemStatus.DROPPED for r in results)
        saved = [(specs[i].kind, r) for i, r in zip(wanted, results)]
        return SaveResult(stored=stored, already=have, rejected=len(specs) - stored - have - dropped,
                          dropped=dropped, results=saved)


def _matched(answers: Mapping[int, LevelAnswer], n: int) -> int:
    m = 0
    while m < n and (got := answers.get(m)) is not None and got.held:
        m += 1
    return m


def _better(a: LevelAnswer, b: LevelAnswer) -> LevelAnswer:
    """Two nodes' answers for one level (owner and replica, or owner and previous owner), combined."""
    held = a.held or b.held
    child = None
    if not held:
        cands = [c for c in (a.child, b.child) if c is not None]
        child = max(cands, key=lambda c: c.usable_tokens) if cands else None
    snaps = [s for s in (a.snapshot, b.snapshot) if s is not None]
    snapshot = max(snaps, key=lambda s: s.usable_tokens) if snaps else None
    return LevelAnswer(level=a.level, held=held, child=child, snapshot=snapshot)


__all__ = ["ClusterClient"]
