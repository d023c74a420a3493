"""CDN-style hot-prefix replication (DESIGN §8).

The owner of an entry (first in rendezvous order of its branch key, protocol/placement.py)
keeps a **decayed read count** per entry it serves::

    value <- value * 2^(-(now - t) / half_life) + 1      on each read
    rate  =  value * ln 2 / half_life                     reads per second, smoothed

Clients spread reads over every copy by load (client/cluster.py), so the owner
sees about 1/copies of the reads; it estimates the entry's total rate as its
own times the number of copies. Copies (the primary included) follow the
rate, one more per ``replication_threshold`` (T) reads a second -- each copy serves about T -- up
to ``replication_max_replicas``::

    rate < T: 1     T <= rate < 2T: 2     2T <= rate < 3T: 3 ...

(Linear, not one more per doubling: under branch placement a hot branch's entries share their
copies' nodes, so a branch read at k*T must reach about k nodes for the load to spread;
benchmarks/balance.py measured max/mean reads per node 1.38 at N=8 with doubling, see
docs/cluster.md.)

Growing happens at those thresholds; shrinking only once the rate has fallen
below half of them (hysteresis), so an entry near a threshold does not flap.
New copies go to the next members in the rendezvous order of the entry's branch (after the
``replicas`` homes every branch has anyway), so a hot branch's copies land together and a node
holding them can answer a walk through the whole branch; different branches' copies land on
different nodes. Dropped copies go furthest-first and the homes are never dropped.

A push is a normal ``/v1/put`` with ``replica: true``: the receiving node's
admission, byte budget and eviction apply exactly as for a client's put, and
it remembers which keys it took as replicas, so only those are deleted by
``/v1/replica/drop`` (and only while unpinned leaves: a node never drops
anything it holds in its own right). A snapshot is pushed with its container (a fork record, when the container is one).
Pushes share a token bucket of ``replication_bytes_per_s`` per node; a push
beyond it waits.

In a store with tenants, pushes carry the cluster token (``cluster_token_file``;
its sha256 is the tenants file's ``cluster_token_sha256``), which reaches
every tenant's namespaces but only to push committed replicas (and drop
them); without it, pushes are refused (counted as failed).

Not done: replica marks live in memory, so a restarted replica node keeps
its replicas as ordinary entries (they age out by eviction).
"""

from __future__ import annotations

import asyncio
import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence

from prefixstore.protocol.errors import ItemStatus, Reason, StoreError
from prefixstore.protocol.keys import Kind
from prefixstore.transport.frames import FramePool, post
from prefixstore.protocol.wire import STATUS_HAVE, STATUS_OK, GetItem, ItemResult, ItemSpec
from .core import Store
from .index import Entry, scope, unscope
from .membership import Membership
from .tasks import stop_task

log = logging.getLogger(__name__)

FORGET_BELOW = 0.05  # decayed reads under which an entry without replicas is no longer tracked


class TokenBucket:
    """``rate`` bytes per second, bursts up to one second's worth; a larger take waits for a full bucket."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = float(rate)
        self.clock = clock
        self.tokens = self.rate
        self.stamp = clock()

    def _fill(self) -> None:
        now = self.clock()
        self.tokens = min(self.rate, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now

    def delay(self, n: int) -> float:
        """Seconds until ``n`` bytes may go (0: now)."""
        self._fill()
        need = min(float(n), self.rate)
        return 0.0 if self.tokens >= need else (need - self.tokens) / self.rate

    def take(self, n: int) -> None:
        self._fill()
        self.tokens -= n  # may go negative for a push larger than the bucket: later pushes wait it off

    async def acquire(self, n: int) -> None:
        while (wait := self.delay(n)) > 0:
            await asyncio.sleep(wait)
        self.take(n)


def copies_for(rate: float, threshold: float, max_copies: int) -> int:
    """Copies (primary included) an entry read ``rate`` times a second gets."""
    if rate < threshold or max_copies <= 1:
        return 1
    return min(max_copies, 1 + int(rate // threshold))


class Replicator:
    def __init__(self, store: Store, membership: Membership, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.membership = membership
        self.config = store.config
        token = self.config.cluster_token()  # checked at start-up (StoreConfig)
        self._auth = f"Bearer {token}" if token else None
        self.clock = clock
        self.enabled = self.config.replication_max_replicas > 1
        self.half_life_s = self.config.replication_half_life_s
        self._reads: dict[bytes, list[float]] = {}  # entry key -> [decayed count, as of time]
        self.pushed: dict[bytes, tuple[str, ...]] = {}  # owner side: entry key -> nodes holding a replica
        # owner side: entry key -> nodes that keep it as a fork record (they refuse its payload; skipped)
        self.refused: dict[bytes, tuple[str, ...]] = {}
        self.replica_keys = store.replica_keys  # receiver side: entries this node took as replicas
        self.bucket = TokenBucket(self.config.replication_bytes_per_s, clock)
        self._pools: dict[str, FramePool] = {}  # per other node
        self._registered: set[tuple[str, bytes]] = set()
        self._task: asyncio.Task[None] | None = None
        self.interval_s = max(0.05, min(1.0, self.half_life_s / 8))
        store.read_hooks.append(self.on_reads)
        store.space.on_delete.append(self._forget)

    # ------------------------------------------------------------ rates

    @property
    def tracked(self) -> int:
        """Entries this node keeps books on (read rates, replica sets): bounded by the index."""
        return len(self._reads) + len(self.pushed) + len(self.refused)

    def _forget(self, e: Entry) -> None:
        """An entry left this node: its read rate, replica set and replica mark go with it, so the
        books never outgrow the index (a single node too, where no tick prunes them)."""
        self._reads.pop(e.key, None)
        self.pushed.pop(e.key, None)
        self.refused.pop(e.key, None)
        self.replica_keys.discard(e.key)

    def on_reads(self, served: list[Entry]) -> None:
        """A get served these entries: each one's decayed read rate grows by one read."""
        if not self.enabled or not self.membership.is_cluster:  # rates matter only where replicas can go
            return
        now = self.clock()
        reads = self._reads
        for e in served:
            slot = reads.get(e.key)
            if slot is None:
                reads[e.key] = [1.0, now]
            else:
                slot[0] = slot[0] * 2.0 ** (-(now - slot[1]) / self.half_life_s) + 1.0
                slot[1] = now

    def rate(self, key: bytes, now: float | None = None) -> float:
        """Smoothed reads per second this node served of ``key``."""
        slot = self._reads.get(key)
        if slot is None:
            return 0.0
        now = self.clock() if now is None else now
        return float(slot[0] * 2.0 ** (-(now - slot[1]) / self.half_life_s) * math.log(2) / self.half_life_s)

    def replicas_of(self) -> dict[bytes, tuple[str, ...]]:
        return self.pushed

    def branch_of(self, e: Entry) -> bytes | None:
        """The branch key that placed an entry here (protocol/placement.py); None if it came without one."""
        return e.branch or None

    # ------------------------------------------------------------ the loop

    async def start(self) -> None:
        if self.enabled and self.membership.is_cluster:
            self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.tick()
            except Exception:  # housekeeping must survive anything
                log.exception("replication tick failed")

    def plan(self) -> tuple[list[tuple[Entry, list[str]]], list[tuple[Entry, list[str]]]]:
        """(pushes, drops): per hot or cooling entry this node owns, the nodes to add or drop."""
        now = self.clock()
        members = self.membership.members
        me = self.membership.self_url
        live = set(members)
        pushes: list[tuple[Entry, list[str]]] = []
        drops: list[tuple[Entry, list[str]]] = []
        for key in list(self._reads):
            e = self.store.index.get(key)
            rate = self.rate(key, now)
            have = tuple(u for u in self.pushed.get(key, ()) if u in live)
            if e is None or e.dead:
                self._reads.pop(key, None)
                self.pushed.pop(key, None)
                self.refused.pop(key, None)
                continue
            if rate * self.half_life_s / math.log(2) < FORGET_BELOW and not have:
                del self._reads[key]
                self.refused.pop(key, None)
                continue
            if not have and rate < self.config.replication_threshold:
                continue  # neither growing nor shrinking: skip the placement work (most keys)
            branch = self.branch_of(e)
            if branch is None or not members:
                continue
            order = self.membership.rank(branch)
            if order[0] != me:
                continue  # not the primary here (a copy, or a key whose owner changed): the owner decides
            homes = min(self.config.replicas, len(order))  # every branch has these copies anyway
            copies = homes + len(have)
            total = rate * copies
            most = max(homes, self.config.replication_max_replicas)
            grow = max(homes, copies_for(total, self.config.replication_threshold, most))
            keep = max(homes, copies_for(2 * total, self.config.replication_threshold, most))
            if grow > copies:
                target = grow
            elif keep < copies:
                target = keep
            else:
                target = copies
            skip = self.refused.get(key, ())
            want = [u for u in order[homes:] if u not in skip][: target - homes]
            add = [u for u in want if u not in have]
            gone = [u for u in have if u not in want]
            if add:
                pushes.append((e, add))
            if gone:
                drops.append((e, gone))
            if have != self.pushed.get(key, ()):
                self.pushed[key] = have  # forget replicas on nodes that left
        return pushes, drops

    async def tick(self) -> None:
        pushes, drops = self.plan()
        for e, nodes in drops:
            for node in nodes:
                await self._drop(e, node)
        for e, nodes in pushes:
            for node in nodes:
                await self._push(e, node)
        self._gauge()

    def _gauge(self) -> None:
        counts = {"kv": 0, "state": 0}
        for key in list(self.replica_keys):
            e = self.store.index.get(key)
            if e is None:
                self.replica_keys.discard(key)
            else:
                counts[e.metric_kind] += 1
        for kind, n in counts.items():
            self.store.metrics.replicas.labels(kind).set(n)

    # ------------------------------------------------------------ node-to-node calls

    def _pool(self, node: str) -> FramePool:
        pool = self._pools.get(node)
        if pool is None or pool.closed:
            context = ssl.create_default_context() if node.startswith("https://") else None
            pool = self._pools[node] = FramePool(node, connect_timeout_s=1.0, ssl_context=context,
                                                 authorization=self._auth)
        return pool

    async def _post(self, node: str, path: str, header: dict[str, object],
                    payloads: Sequence[bytes] = ()) -> dict[str, object]:
        """One call to another node over the frame transport (transport/frames.py); raises StoreError."""
        return await post(self._pool(node), path, header, payloads,
                          timeout_s=max(5.0, self.config.request_timeout_s / 4))

    def _spec(self, e: Entry) -> ItemSpec:
        branch = e.branch or None
        if e.kind is Kind.STATE:
            assert e.container is not None
            return ItemSpec(kind=e.kind, hash=e.hash, size=e.size, container=unscope(e.container), boundary=e.boundary,
                            checksum=e.checksum, origin=e.origin, branch=branch)
        return ItemSpec(kind=e.kind, hash=e.hash, size=e.size, parent=e.parent, tokens=e.tokens, extra=e.extra,
                        checksum=e.checksum, start=e.start, branch=branch, record=e.record)

    async def _payloads(self, entries: list[Entry]) -> list[bytes] | None:
        """The payloads of ``entries`` (a fork record's is empty); None if one is gone."""
        ns_id = entries[0].namespace_id
        read = [e for e in entries if not e.record]
        plan = await self.store.prepare_get(ns_id, [GetItem(key=e.wire_key) for e in read])
        try:
            if any(s.status != STATUS_OK for s in plan.slots):
                return None
            got = {e.key: b"".join(bytes(v) for v in self.store.payload_views(s)) for e, s in zip(read, plan.slots)}
        finally:
            self.store.finish_get(plan)
        return [got.get(e.key, b"") for e in entries]

    async def _push(self, e: Entry, node: str) -> None:
        metrics = self.store.metrics
        batch = [e]
        if e.kind is Kind.STATE:  # a snapshot needs its container on the same node
            c = self.store.index.get(e.container or b"")
            if c is None:
                metrics.replication_pushes.labels("skipped").inc()
                return
            batch = [c, e]
        ns = self.store.namespaces.find(e.namespace_id)
        if ns is None:
            return
        try:
            # Reading the payloads counts as reads of our own; do not let them heat the entry.
            saved = {x.key: list(self._reads[x.key]) for x in batch if x.key in self._reads}
            payloads = await self._payloads(batch)
            for k, v in saved.items():
                if k in self._reads:
                    self._reads[k][:] = v
            if payloads is None:
                metrics.replication_pushes.labels("skipped").inc()
                return
            size = sum(len(p) for p in payloads)
            await self.bucket.acquire(size)
            if (node, ns.id) not in self._registered:
                await self._post(node, "/v1/namespaces", {"namespace": ns.to_wire()})
                self._registered.add((node, ns.id))
            answer = await self._post(node, "/v1/put", {
                "ns": ns.id, "commit": True, "replica": True,
                "items": [self._spec(x).to_wire() for x in batch]}, payloads)
            raw = answer.get("results")
            results = [ItemResult.from_wire(r) for r in raw] if isinstance(raw, list) else []
        except (StoreError, ValueError) as err:
            metrics.replication_pushes.labels("failed").inc()
            self._registered.discard((node, e.namespace_id))
            log.debug("replica push of %s to %s failed: %s", e.key.hex(), node, err)
            return
        mine = results[-1] if len(results) == len(batch) else ItemResult(ItemStatus.REJECTED, Reason.MALFORMED)
        if mine.status in (STATUS_OK, STATUS_HAVE):
            metrics.replication_pushes.labels("ok").inc()
            metrics.replication_bytes.inc(size)
            self.pushed[e.key] = tuple(sorted(set(self.pushed.get(e.key, ())) | {node}))
        else:
            metrics.replication_pushes.labels("skipped").inc()  # the receiver's admission or budget said no
            if mine.reason is Reason.RECORD:  # that node is the level's home: the next node takes the copy
                self.refused[e.key] = tuple(sorted(set(self.refused.get(e.key, ())) | {node}))

    async def _drop(self, e: Entry, node: str) -> None:
        self.pushed[e.key] = tuple(u for u in self.pushed.get(e.key, ()) if u != node)
        if not self.pushed[e.key]:
            del self.pushed[e.key]
        try:
            await self._post(node, "/v1/replica/drop", {"ns": e.namespace_id, "keys": [e.wire_key]})
        except (StoreError, ValueError) as err:
            log.debug("replica drop of %s on %s failed: %s", e.key.hex(), node, err)

    # ------------------------------------------------------------ receiver side

    def mark_replicas(self, keys: list[bytes]) -> None:
        self.replica_keys.update(keys)
        self._gauge()

    async def drop(self, ns_id: bytes, keys: list[bytes]) -> int:
        """Delete entries this node holds as replicas (unpinned leaves only); returns how many."""
        dropped = 0
        for wire_key in keys:
            key = scope(ns_id, wire_key)
            e = self.store.index.get(key)
            if key not in self.replica_keys or e is None:
                continue
            self.replica_keys.discard(key)
            if e.pins or not e.is_leaf:
                # In use, or the parent of entries this node holds in its own right (a block's
                # children live by its hash, possibly here): it stays as an ordinary entry, no
                # longer advertised as a replica, and eviction takes it when it is cold.
                continue
            self.store.delete(e, "replica_dropped")
            dropped += 1
        if dropped:
            await self.store.flush_deletes()
        self._gauge()
        return dropped


__all__ = ["Replicator", "TokenBucket", "copies_for"]
