"""The write path: offer, admit, reserve, verify, commit (DESIGN §6).

Entry life cycle::

    offer --want--> put --> pending (pages held, invisible) --commit--> committed
                                |  expires after pending_ttl_s        |  index + LMDB (sync: first; write-behind: after)
                                v                                     v
                             reclaimed                     visible to lookups and reads

Decided here: which items are taken (shape, hash, parent, room, quota, admission) — every key
recomputed from its contents (store/validate.py) and scoped by its namespace (store/index.py).
Moved elsewhere: payload bytes (the HTTP plane streams them into the pages ``plan_put``
reserves; NIXL WRITEs them), and space (store/space.py makes room and deletes).

Cluster placement (protocol/placement.py) is decided here too, at offers: a block offered to the
home of its level is a continuation (the first block child of its parent here, claimed for
``pending_ttl_s`` so two concurrent saves do not both take it) or a fork head (``fork`` in its
result: the client puts its record here and the block on its branch node); the items of the
offer below a fork head answer ``elsewhere``. A put takes what its items say (a record, or a
block) without deciding again, so every copy of a branch stores what its home decided.

Rules: a pending entry pins its parent or container (anchor) until it commits or is dropped, so
they survive until the commit; a block whose parent is another node's (a cluster) pins nothing.
The pending entry keeps the pinned anchor itself (``Entry.anchor``), not its key: an anchor
deleted meanwhile (a flush, a damaged tier, a corruption cascade) is unpinned all the same, and
its pages freed with its last pin. Durability (``durability``): ``sync`` writes through to LMDB before
indexing, so a SIGKILLed store serves every entry it acknowledged, and a write that the tier's reset
overtook is not indexed; ``write-behind`` indexes first and queues the entries for the writer
(store/behind.py), so a SIGKILLed store loses at most what was behind its bounds, never returns
other bytes (every payload read from LMDB is checked against its record's checksum).
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from prefixstore.admission import AdmissionPolicy, EvictionPolicy
from prefixstore.protocol import checksums
from prefixstore.protocol.errors import ItemStatus, Problem, Reason
from prefixstore.protocol.hashing import HASH_BYTES, BlockHash
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import ItemResult, ItemSpec, WireError
from .arena import Arena
from .behind import WriteBehind, puts_of
from .config import StoreConfig
from .disk import Disk
from .index import STORE_KEY_BYTES, Entry, Index, entry_charge, scope, store_key
from .ledger import TenantLedger
from .lmdb_tier import StoredRecord, TierFull
from .metrics import StoreMetrics
from .namespaces import Namespaces
from .space import Space
from .validate import check_item, snapshot_hash

log = logging.getLogger(__name__)

_PENDING = ItemResult(ItemStatus.PENDING)
_COMMITTING = math.inf  # expires_s of a pending entry whose commit is in flight
_ORDER = {Kind.BLOCK: 0, Kind.TAIL: 1, Kind.STATE: 2}  # parents before children
MAX_CLAIMS = 1 << 16  # continuation claims of offered blocks not yet committed (oldest forgotten first)


@dataclass(slots=True)
class PutPlan:
    """Where each payload of a put body goes: arena extents, or None to skip its bytes."""

    namespace_id: bytes
    sizes: list[int]
    extents: list[list[tuple[int, int]] | None]  # per item: (start, end) byte ranges in the arena
    arena: Arena
    results: list[ItemResult]
    entries: list[Entry | None]

    @property
    def targets(self) -> list[list[memoryview] | None]:
        """Per item: the arena views its payload fills, in order, or None (its bytes are skipped)."""
        view = self.arena.view
        return [None if ext is None else [view[lo:hi] for lo, hi in ext] for ext in self.extents]

    def body(self) -> list[memoryview | int]:
        """The whole body after the header, in order: views to fill (the payloads of items in
        adjacent pages merged into one view) and byte counts to skip (items not taken)."""
        out: list[memoryview | int] = []
        run: list[tuple[int, int]] = []
        skip = 0
        for size, ext in zip(self.sizes, self.extents):
            if ext is None:
                skip += size
                continue
            if skip:
                out += self.arena.coalesce(run)
                out.append(skip)
                run, skip = [], 0
            run += ext
        out += self.arena.coalesce(run)
        if skip:
            out.append(skip)
        return out

    @property
    def keys(self) -> list[bytes]:
        """Wire entry keys of the entries this put reserved, for :meth:`WritePath.commit`."""
        return [e.wire_key for e in self.entries if e is not None]

    @property
    def over_quota(self) -> list[int]:
        """Indices of the items refused because the tenant is at its quota."""
        return [i for i, r in enumerate(self.results) if r.reason is Reason.QUOTA]


class WritePath:
    def __init__(self, *, config: StoreConfig, index: Index, arena: Arena, namespaces: Namespaces,
                 ledger: TenantLedger, space: Space, disk: Disk, behind: WriteBehind, admission: Mapping[Kind, AdmissionPolicy],
                 eviction: EvictionPolicy, metrics: StoreMetrics, clock: Callable[[], float]) -> None:
        self._config = config
        self._index = index
        self._arena = arena
        self._namespaces = namespaces
        self._ledger = ledger
        self._space = space
        self._disk = disk
        self._behind = behind
        self._admission = admission
        self._eviction = eviction
        self._metrics = metrics
        self._clock = clock
        # In a cluster a block usually lives on another node than its parent (protocol/placement.py),
        # so prefix closure holds per cluster, not per node: a block or tail may name a parent this
        # node does not hold.
        self.foreign_parents = bool(config.peer_urls or config.peers_dns)
        self.pending: dict[bytes, Entry] = {}
        # Offered and wanted, per owner, oldest first: admitted at put without asking again.
        # At most max_offers_per_tenant each (an owner flooding offers forgets its own oldest).
        self._wanted: dict[str, OrderedDict[bytes, float]] = {}
        # Admission decisions of puts refused whole over the tenant's quota, per owner, oldest
        # first: key -> (admitted, until when). The client offers such a batch next, so that what
        # fits is stored; its offer takes these decisions instead of asking admission again, and
        # each item is seen once per save (a second-hit policy would otherwise take a snapshot on
        # its first save). At most max_offers_per_tenant each, like the wants.
        self._decided: dict[str, OrderedDict[bytes, tuple[bool, float]]] = {}
        # Cluster: parent node key -> (the block offered as its continuation, until when).
        self._claims: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()

    def offers_of(self, owner: str) -> int:
        return len(self._wanted.get(owner, ()))

    # ------------------------------------------------------------ deciding

    def _find(self, key: bytes, batch: Mapping[bytes, Entry]) -> Entry | None:
        return batch.get(key) or self.pending.get(key) or self._index.get(key)

    def _resolve(self, ns: Namespace, item: ItemSpec, key: bytes, batch: Mapping[bytes, Entry],
                 now: float, ctx: str) -> Entry | Reason:
        """A new (uncommitted) entry for the item, or the reason it cannot be taken."""
        ns_id = ns.id
        if item.kind is Kind.STATE:
            assert item.container is not None
            container = scope(ns_id, item.container)
            c = self._find(container, batch)
            if c is None:
                return Reason.CONTAINER_MISSING
            expected = snapshot_hash(c, item.boundary)
            if expected is None:
                raise WireError(f"{ctx}boundary", f"{item.boundary} is outside the container's token range "
                                f"({c.start}, {c.end}]")
            if expected != item.hash:
                raise WireError(f"{ctx}hash", f"does not equal p({item.boundary}) of the container's tokens")
            return Entry(key=key, kind=Kind.STATE, hash=item.hash, namespace_id=ns_id, parent=None, start=0,
                         tokens=b"", extra=b"", container=container, boundary=item.boundary,
                         size=item.size, checksum=item.checksum or 0, last_access_s=now, origin=item.origin,
                         branch=item.branch or b"")
        assert item.parent is not None
        if item.parent == self._namespaces.root(ns_id):
            start = 0
        else:
            p = self._find(store_key(ns_id, Kind.BLOCK, item.parent), batch)
            if p is not None:
                start = p.end
            elif self.foreign_parents and item.start is not None:
                # Cluster: the parent is another node's; the client says where the block starts.
                B = ns.block_tokens
                if item.start <= 0 or item.start % B:
                    raise WireError(f"{ctx}start", f"{item.start} is not a positive multiple of the block size {B}")
                start = item.start
            else:
                return Reason.PARENT_MISSING
        return Entry(key=key, kind=item.kind, hash=item.hash, namespace_id=ns_id, parent=item.parent, start=start,
                     tokens=item.tokens, extra=item.extra, container=None, boundary=0, size=item.size,
                     checksum=item.checksum or 0, last_access_s=now, record=item.record, branch=item.branch or b"")

    def _under_fork(self, ns: Namespace, item: ItemSpec, below: set[bytes], forks: set[bytes]) -> bytes | None:
        """The fork head (or block below one) an item hangs from, when its place is that branch's
        node, not here: a block or tail under a fork head or a block of the same offer below one,
        or under a fork record held here; a snapshot whose container is below a fork head (one in
        a fork head itself belongs to the head's level, here)."""
        if item.branch is not None and item.branch == item.hash:
            return None  # a branch's first block: it belongs on this node whatever its parent is here
        if item.kind is Kind.STATE:
            under = item.container[1:] if item.container else None
            return under if under is not None and under in below and under not in forks else None
        assert item.parent is not None
        if item.parent in below:
            return item.parent
        p = self._index.get_block(ns.id, item.parent)
        return item.parent if p is not None and p.record else None

    def _forks(self, ns: Namespace, item: ItemSpec, key: bytes, now: float) -> bool:
        """Whether a block offered to the home of its level is a fork head there (module docstring).
        Only in a cluster, only for a block placed by its level's branch (a branch's first block,
        whose branch key is its own hash, is never a fork on its own node)."""
        if not self.foreign_parents or item.kind is not Kind.BLOCK or item.record or item.branch is None \
                or item.branch == item.hash:
            return False
        assert item.parent is not None
        if item.parent == self._namespaces.root(ns.id):
            return True  # every first block is a fork head: the root level only keeps records
        node = ns.id + item.parent
        first = self._index.continuation.get(node)
        if first is not None:
            return first != key
        claim = self._claims.get(node)
        if claim is not None and claim[1] > now and claim[0] != key:
            return True
        self._claims[node] = (key, now + self._config.pending_ttl_s)
        self._claims.move_to_end(node)
        while len(self._claims) > MAX_CLAIMS:
            self._claims.popitem(last=False)
        return False

    def _triage(self, ns: Namespace, items: Sequence[ItemSpec], for_put: bool, place: bool = True,
                sighted: list[tuple[bytes, bool]] | None = None) -> tuple[list[ItemResult], list[Entry | None]]:
        """First pass of offer and put: validate everything, allocate nothing. ``sighted`` collects
        the admission decisions it asked for (key, admitted)."""
        owner = self._ledger.owner_of(ns)
        decided = self._decided.get(owner)
        now = self._clock()
        taken = self._ledger.bytes_of(ns.tenant)  # plus what this batch takes, below
        counted = self._ledger.entries_of(ns.tenant)  # ... and entries, likewise
        batch: dict[bytes, Entry] = {}
        results: list[ItemResult] = []
        new: list[Entry | None] = []
        below: set[bytes] = set()  # cluster offers: fork heads and the blocks offered under them
        batch_forks: set[bytes] = set()  # ... the fork heads themselves (their snapshots stay here)
        heads: dict[bytes, bytes] = {}  # a block below a fork head -> that head (its branch key)
        for i, item in enumerate(items):
            ctx = f"items[{i}]."
            check_item(ns, item, ctx)
            if for_put and item.checksum is None and not item.record:
                raise WireError(f"{ctx}checksum", "a put item needs the xxh3-64 of its payload")
            key = store_key(ns.id, item.kind, item.hash)  # scoped: only this namespace's entries answer
            under = self._under_fork(ns, item, below, batch_forks)
            if under is not None:
                branch = heads.get(under, under)
                results.append(ItemResult(ItemStatus.ELSEWHERE, Reason.FORK_BRANCH,
                                          branch=branch))
                new.append(None)
                if item.kind is not Kind.STATE:
                    below.add(item.hash)
                    heads[item.hash] = branch
                continue
            known = self._find(key, batch)
            if known is not None and for_put and known.record and not item.record:
                # Never a payload over the record that keeps this level exact (and never a replica
                # that a drop would delete together with the record).
                results.append(ItemResult(ItemStatus.REJECTED, Reason.RECORD))
                new.append(None)
                continue
            if known is not None:
                fork = known.record and not for_put
                if fork:
                    below.add(item.hash)
                    batch_forks.add(item.hash)
                results.append(ItemResult(ItemStatus.HAVE, fork=fork))
                new.append(None)
                continue
            got = self._resolve(ns, item, key, batch, now, ctx)
            if isinstance(got, Reason):
                results.append(ItemResult(ItemStatus.REJECTED, got))
                new.append(None)
                continue
            fork = not for_put and place and self._forks(ns, item, key, now)
            if fork:
                # The home keeps this block's record: charged and counted as one, never admitted as a payload.
                got.record, got.size = True, 0
                below.add(item.hash)
                batch_forks.add(item.hash)
            if item.record or fork:
                charge = entry_charge(0, item.tokens, item.extra)
                if self._ledger.over_quota(ns, charge, taken) or self._ledger.over_entries(ns, counted):
                    results.append(ItemResult(ItemStatus.REJECTED, Reason.QUOTA, fork=fork))
                    new.append(None)
                    continue
                batch[key] = got
                taken += charge
                counted += 1
                results.append(ItemResult(ItemStatus.WANT, fork=fork))
                new.append(got)
                continue
            if self._arena.pages_for(item.size) > self._arena.num_pages:
                results.append(ItemResult(ItemStatus.REJECTED, Reason.TOO_LARGE))
                new.append(None)
                continue
            charge = entry_charge(item.size, item.tokens, item.extra)
            if self._ledger.over_quota(ns, charge, taken) or self._ledger.over_entries(ns, counted):
                results.append(ItemResult(ItemStatus.REJECTED, Reason.QUOTA))
                new.append(None)
                continue
            offers = self._wanted.get(owner) if for_put else None
            wanted = offers is not None and offers.pop(key, None) is not None
            if not wanted:
                before = decided.pop(key, None) if decided else None
                if before is not None and before[1] > now:
                    wanted = before[0]
                else:
                    wanted = self._admission[item.kind].admit(item.kind, key, item.size, now, item.origin)
                    if sighted is not None:
                        sighted.append((key, wanted))
            if not wanted:
                results.append(ItemResult(ItemStatus.REJECTED, Reason.ADMISSION))
                new.append(None)
                continue
            batch[key] = got
            taken += charge
            counted += 1
            results.append(ItemResult(ItemStatus.WANT))
            new.append(got)
        return results, new

    def offer(self, ns: Namespace, items: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        """Per item: want / have / rejected. Bytes move only for wanted items. ``place`` (a cluster):
        decide continuations and fork heads (module docstring); without it every block is taken
        as it is offered (a client that puts what it was told to, keeping its chain here)."""
        results, _ = self._triage(ns, items, for_put=False, place=place)
        now = self._clock()
        wanted = self._wanted.setdefault(self._ledger.owner_of(ns), OrderedDict())
        self._count(Counter((item.kind.metric_kind, r.status) for item, r in zip(items, results)))
        for item, r in zip(items, results):
            if r.status is ItemStatus.WANT:
                key = store_key(ns.id, item.kind, item.hash)
                wanted.pop(key, None)  # a repeat offer moves to the back, so expiry stays in order
                wanted[key] = now + self._config.pending_ttl_s
        while len(wanted) > self._config.max_offers_per_tenant:
            wanted.popitem(last=False)  # the owner's oldest: its put will ask admission again
        return results

    # ------------------------------------------------------------ reserving

    def _anchor_key(self, e: Entry) -> bytes | None:
        if e.kind is Kind.STATE:
            return e.container
        assert e.parent is not None
        return None if e.parent == self._namespaces.root(e.namespace_id) else e.parent_key

    def plan_put(self, ns: Namespace, items: Sequence[ItemSpec],
                 sighted: list[tuple[bytes, bool]] | None = None) -> PutPlan:
        """Decide each item and reserve arena pages for the ones taken (``sighted``: _triage's)."""
        results, new = self._triage(ns, items, for_put=True, sighted=sighted)
        now = self._clock()
        # Pin every anchor (parent / container) before allocating: making room
        # may evict, and must not evict what this batch builds on.
        in_batch = {e.key: e for e in new if e is not None}
        for e in new:
            anchor_key = self._anchor_key(e) if e is not None else None
            anchor = (in_batch.get(anchor_key) or self._find(anchor_key, {})) if anchor_key else None
            if e is not None and anchor is not None:
                anchor.pins += 1  # held until the entry commits or is dropped
                e.anchor = anchor  # None: a root, or (cluster) a parent another node holds
        # One pass, batch-shaped: room made once for the batch (demotion or eviction), decisions
        # counted per (kind, decision) and the tenant charged once for the request, not per item
        # (a 64 MiB put of 64 KiB blocks has 1024 items).
        self._space.make_room(sum(self._arena.pages_for(e.size) for e in new if e is not None and not e.record))
        decisions: Counter[tuple[str, ItemStatus]] = Counter()
        extents: list[list[tuple[int, int]] | None] = []
        failed: set[bytes] = set()
        expires = now + self._config.pending_ttl_s
        pending = self.pending
        arena = self._arena
        charged = 0
        entries = 0
        for i, (item, e) in enumerate(zip(items, new)):
            if e is None:
                extents.append(None)
                decisions[item.kind.metric_kind, ItemStatus.HAVE if results[i].status is ItemStatus.HAVE
                          else ItemStatus.REJECTED] += 1
                continue
            dep = self._anchor_key(e)
            if e.record:  # no payload: nothing to reserve, no bytes in the body
                if dep in failed:
                    failed.add(e.key)
                    self._release_anchor(e)
                    results[i] = ItemResult(ItemStatus.REJECTED, Reason.PARENT_MISSING)
                    new[i] = None
                    extents.append(None)
                    continue
                e.expires_s = expires
                pending[e.key] = e
                charged += e.charge
                entries += 1
                extents.append(None)
                results[i] = _PENDING
                continue
            pages = None if dep in failed else self._space.allocate(e.size)
            if pages is None:
                failed.add(e.key)
                self._release_anchor(e)
                results[i] = ItemResult(ItemStatus.REJECTED,
                                        Reason.PARENT_MISSING if dep in failed else Reason.RAM_PINNED)
                new[i] = None
                extents.append(None)
                decisions[item.kind.metric_kind, ItemStatus.REJECTED] += 1
                continue
            e.pages = pages
            e.expires_s = expires
            pending[e.key] = e
            charged += e.charge
            entries += 1
            extents.append(list(arena.extents(pages, 0, e.size)))
            results[i] = _PENDING
            decisions[item.kind.metric_kind, ItemStatus.WANT] += 1
        if charged:
            self._ledger.charge(ns, charged, entries)
        self._count(decisions)
        return PutPlan(namespace_id=ns.id, sizes=[it.size for it in items], extents=extents, arena=arena,
                       results=results, entries=new)

    def _count(self, decisions: Counter[tuple[str, ItemStatus]]) -> None:
        """Admission decisions of one request: one ``labels()`` per (kind, decision), not per item."""
        for (kind, decision), n in decisions.items():
            self._metrics.admission.labels(kind, decision).inc(n)

    def reserve(self, ns: Namespace, items: Sequence[ItemSpec]) -> PutPlan:
        """:meth:`plan_put` for a put that moves bytes: refused *whole* (nothing reserved) when any
        item would take the tenant over its quota, before any payload byte is read, so the engine
        is told plainly (an offer, which moves no bytes, answers per item instead)."""
        sighted: list[tuple[bytes, bool]] = []
        plan = self.plan_put(ns, items, sighted)
        over = plan.over_quota
        if over:
            self.abort_put(plan)
            decided = self._decided.setdefault(self._ledger.owner_of(ns), OrderedDict())
            until = self._clock() + self._config.pending_ttl_s
            for key, admitted in sighted:
                decided.pop(key, None)
                decided[key] = (admitted, until)
            while len(decided) > self._config.max_offers_per_tenant:
                decided.popitem(last=False)
            share = self._ledger.entry_share
            raise WireError("quota", f"tenant {ns.tenant!r} would exceed its quota of {self._ledger.quota_of(ns)} "
                            f"bytes (holds {self._ledger.bytes_of(ns.tenant)})"
                            + (f" or its share of max_entries, {share} entries (holds "
                               f"{self._ledger.entries_of(ns.tenant)})" if share is not None else "")
                            + f"; items {over[:8]} do not fit; nothing of this put was stored", Problem.QUOTA)
        return plan

    def abort_put(self, plan: PutPlan) -> None:
        """The body did not arrive whole: forget every entry this put reserved."""
        for e in plan.entries:
            if e is not None and self.pending.get(e.key) is e:
                self.drop_pending(e)

    def verify_put(self, plan: PutPlan) -> None:
        """After the body arrived: drop items whose bytes do not match their checksum. One native
        call hashes the batch with the GIL released (protocol/checksums.py), so the LMDB writer
        thread runs beside it."""
        if self._arena.virtual:
            return
        view = self._arena.view
        idx: list[int] = []  # items in one run of pages: hashed together below
        views: list[memoryview] = []
        sums: list[int] = []
        verdict: dict[int, bool] = {}
        for i, (e, ext) in enumerate(zip(plan.entries, plan.extents)):
            if e is None or ext is None or self.pending.get(e.key) is not e or e.record:
                continue
            if len(ext) == 1:
                idx.append(i)
                views.append(view[ext[0][0] : ext[0][1]])
                sums.append(e.checksum)
            else:  # pages not adjacent: hashed run by run
                assert e.pages is not None
                verdict[i] = self._arena.checksum(e.pages, 0, e.size) == e.checksum
        verdict.update(zip(idx, checksums.verify(views, sums)))
        bad = 0
        for i, good in verdict.items():
            if not good:
                e = plan.entries[i]
                assert e is not None
                self.drop_pending(e)
                plan.entries[i] = None
                plan.results[i] = ItemResult(ItemStatus.REJECTED, Reason.CHECKSUM)
                bad += 1
        if bad:
            self._metrics.checksum_failures.labels("network").inc(bad)

    def verify_pending(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[list[ItemResult], int]:
        """The NIXL path's verify_put: payloads were WRITTEN into reserved pages, not streamed.
        Per wire key: pending (its pages hold bytes matching its checksum), rejected (dropped: they
        do not), or missing; plus the payload bytes verified."""
        out: list[ItemResult] = []
        received = 0
        for key in keys:
            e = self.pending.get(scope(ns_id, key))
            if e is None or e.pages is None or e.expires_s == _COMMITTING:
                out.append(ItemResult(ItemStatus.MISSING, Reason.NOT_RESERVED))
                continue
            if self._arena.checksum(e.pages, 0, e.size) != e.checksum:
                self.drop_pending(e)
                out.append(ItemResult(ItemStatus.REJECTED, Reason.CHECKSUM))
                self._metrics.checksum_failures.labels("network").inc()
                continue
            received += e.size
            out.append(ItemResult(ItemStatus.PENDING))
        return out, received

    def drop_pending(self, e: Entry) -> None:
        del self.pending[e.key]
        self._space.charge(e, -1)
        e.dead = True
        if e.pages is not None:
            self._arena.free(e.pages)
            e.pages = None
        self._release_anchor(e)

    def _release_anchor(self, e: Entry) -> None:
        anchor, e.anchor = e.anchor, None
        if anchor is not None:
            self._space.unpin(anchor)

    def sweep(self, now: float) -> None:
        """Reclaim expired pending puts; forget expired offers."""
        for e in list(self.pending.values()):
            if e.expires_s <= now:
                self.drop_pending(e)
                self._metrics.evictions.labels(e.metric_kind, "expired").inc()
        while self._claims and next(iter(self._claims.values()))[1] <= now:
            self._claims.popitem(last=False)
        for owner, wanted in list(self._wanted.items()):
            while wanted and next(iter(wanted.values())) <= now:  # oldest first: same TTL for all
                wanted.popitem(last=False)
            if not wanted:
                del self._wanted[owner]
        for owner, decided in list(self._decided.items()):
            while decided and next(iter(decided.values()))[1] <= now:
                decided.popitem(last=False)
            if not decided:
                del self._decided[owner]

    # ------------------------------------------------------------ committing

    def attachable(self, e: Entry) -> bool:
        """Whether an entry can become visible: its container, or its parent (or a root, or, in a
        cluster, a parent another node holds) is indexed and lines up with it."""
        if e.kind is Kind.STATE:
            c = self._index.get(e.container or b"")
            return c is not None and c.start < e.boundary <= c.end
        assert e.parent is not None
        if e.parent == self._namespaces.root(e.namespace_id):
            return e.start == 0
        p = self._index.get_block(e.namespace_id, e.parent)
        if p is None and self.foreign_parents:  # the parent lives on another node
            ns = self._namespaces.find(e.namespace_id)
            return ns is not None and e.start > 0 and e.start % ns.block_tokens == 0
        return p is not None and p.end == e.start

    async def commit(self, ns_id: bytes, keys: Sequence[bytes]) -> list[ItemResult]:
        """Make pending entries visible. ``durability = "sync"``: persist them (write-through), then
        index them; ``write-behind``: index them, then queue them for the writer (store/behind.py),
        after waiting while it is over its bounds. ``keys`` are wire entry keys (kind || hash) of
        namespace ``ns_id``."""
        self._namespaces.get(ns_id)
        behind = self._disk.enabled and self._behind.enabled
        # Back-pressure, before anything of this commit is decided; False: the disk is full and the
        # write-behind at its bounds, so this commit is refused like a sync one (below).
        disk_full = behind and not await self._behind.room()
        results: list[ItemResult] = [ItemResult(ItemStatus.MISSING, Reason.NOT_PUT)] * len(keys)
        batch: list[tuple[int, Entry]] = []
        pending = self.pending
        for i, wire_key in enumerate(keys):
            key = scope(ns_id, wire_key)
            e = pending.get(key)
            if e is None:
                if self._index.get(key) is not None:
                    results[i] = ItemResult(ItemStatus.HAVE)
                continue
            if e.expires_s == _COMMITTING:
                results[i] = ItemResult(ItemStatus.PENDING, Reason.COMMITTING)
                continue
            e.expires_s = _COMMITTING
            batch.append((i, e))
        if not batch:
            return results
        # Parents before children whatever order the client listed them in.
        batch.sort(key=lambda ie: (_ORDER[ie[1].kind], ie[1].start))
        if disk_full or (self._disk.enabled and not behind and self._disk.refusing()):
            return self._refuse(batch, results)
        if self._disk.enabled:
            if not self._space.enforce_disk_budget(sum(e.charge for _, e in batch) + self._behind.bytes):
                for i, e in batch:
                    self.drop_pending(e)
                    results[i] = ItemResult(ItemStatus.REJECTED, Reason.DISK_PINNED)
                return results
        if not self._space.enforce_entry_budget(len(batch)):
            for i, e in batch:
                self.drop_pending(e)
                results[i] = ItemResult(ItemStatus.REJECTED, Reason.ENTRIES_PINNED)
            return results
        if self._disk.enabled and not behind:
            failure: str | None = None  # the detail of a DISK_FAILED refusal
            try:
                if not await self._disk.write(puts_of(self._arena, [e for _, e in batch])):
                    failure = "the tier was damaged and reset"
            except TierFull:
                return self._refuse(batch, results)
            except Exception as err:
                log.exception("LMDB write failed; %d entries not committed", len(batch))
                failure = type(err).__name__
            if failure is not None:
                for i, e in batch:
                    if pending.get(e.key) is e:
                        self.drop_pending(e)
                    results[i] = ItemResult(ItemStatus.REJECTED, Reason.DISK_FAILED, detail=failure)
                return results
        now = self._clock()
        on_disk = self._disk.enabled and not behind
        entries = self._index.entries
        ok = ItemResult(ItemStatus.OK)
        queued: list[Entry] = []
        for i, e in batch:
            if pending.get(e.key) is not e:  # dropped while the write was in flight
                results[i] = ItemResult(ItemStatus.REJECTED, Reason.DROPPED_BEFORE_COMMIT)
                if on_disk:
                    self._disk.doom(e.key)
                continue
            if not self.attachable(e) or e.key in entries:
                gone = e.key not in entries
                self.drop_pending(e)
                if gone and on_disk:
                    self._disk.doom(e.key)
                results[i] = ItemResult(ItemStatus.REJECTED, Reason.ANCHOR_GONE) if gone \
                    else ItemResult(ItemStatus.HAVE)
                continue
            del pending[e.key]
            e.on_disk = on_disk
            e.last_access_s = now
            self._index.insert(e)
            self._eviction.on_store(e, now)
            anchor_key = self._anchor_key(e)
            parent = self._index.get(anchor_key) if anchor_key is not None else None
            if parent is not None:
                self._space.delete_queue.discard(parent)  # it has a dependant now
            self._release_anchor(e)
            self._space.requeue(e, now)  # an entry behind the writer joins no RAM queue: never demoted
            results[i] = ok
            if behind:
                queued.append(e)
        if queued:
            self._behind.add(queued)
        return results

    def _refuse(self, batch: list[tuple[int, Entry]], results: list[ItemResult]) -> list[ItemResult]:
        """A commit the disk cannot take: its entries are dropped (their pages freed), refused."""
        for i, e in batch:
            if self.pending.get(e.key) is e:
                self.drop_pending(e)
            results[i] = ItemResult(ItemStatus.REJECTED, Reason.DISK_FULL)
        self._metrics.lmdb_full_refusals.inc(len(batch))
        return results

    # ------------------------------------------------------------ restart

    def adopt(self, records: Sequence[StoredRecord]) -> list[bytes]:
        """Index what LMDB held at start-up; returns the keys of records to delete from it.

        Nothing read back is trusted: every record's key is re-derived from its contents (parent,
        tokens and extra keys; a snapshot's p(t) from its container's tokens) and its sizes
        checked against its namespace, exactly as a put is checked (store/validate.py). A record
        that fails is dropped, so a flipped byte on disk is a miss, never an entry answering for
        tokens it does not hold."""
        usable = [r for r in records if len(r.key) == STORE_KEY_BYTES and r.key[0] in _ORDER]
        dropped = [r.key for r in records if len(r.key) != STORE_KEY_BYTES or r.key[0] not in _ORDER]
        usable.sort(key=lambda r: (_ORDER[Kind(r.key[0])], r.start))
        for r in usable:
            e = Entry(key=r.key, kind=Kind(r.key[0]), hash=BlockHash(r.key[-HASH_BYTES:]), namespace_id=r.namespace_id,
                      parent=BlockHash(r.parent) if r.parent else None, start=r.start, tokens=r.tokens,
                      extra=r.extra, container=r.container, boundary=r.boundary, size=r.size,
                      checksum=r.checksum, on_disk=True, origin=r.origin, record=r.record, branch=r.branch)
            if not self._rederives(e) or not self.attachable(e):
                dropped.append(r.key)
                continue
            self._index.insert(e)
            self._space.charge(e, 1)
        for e in self._index.entries.values():
            e.priority = self._eviction.priority(e, 0.0)
            if e.is_leaf:
                self._space.delete_queue.update(e, e.priority)
        return dropped

    def _rederives(self, e: Entry) -> bool:
        """Whether a record read back from disk is what a put of it would have been: its key is
        its namespace's, its hash follows from its contents, its sizes from its namespace."""
        ns = self._namespaces.find(e.namespace_id)
        if ns is None or e.key != store_key(ns.id, e.kind, e.hash) or (e.size <= 0) != e.record \
                or e.checksum >= 1 << 64:
            return False
        try:
            if e.kind is Kind.STATE:
                c = self._index.get(e.container or b"")
                if c is None or c.namespace_id != ns.id or c.kind is Kind.STATE:
                    return False
                check_item(ns, ItemSpec(kind=e.kind, hash=e.hash, size=e.size), "")
                return snapshot_hash(c, e.boundary) == e.hash
            if e.parent is None or len(e.parent) != HASH_BYTES or e.container is not None:
                return False
            check_item(ns, ItemSpec(kind=e.kind, hash=e.hash, size=e.size, parent=e.parent, tokens=e.tokens,
                                    extra=e.extra, record=e.record), "")
        except WireError:
            return False
        return True

    def pending_bytes(self) -> dict[str, int]:
        """Bytes of pending entries per tenant (Store.check)."""
        out: dict[str, int] = {}
        for e in self.pending.values():
            ns = self._namespaces.find(e.namespace_id)
            if ns is not None:
                out[ns.tenant] = out.get(ns.tenant, 0) + e.charge
        return out


__all__ = ["PutPlan", "WritePath"]
