"""The store: index + RAM arena + LMDB tier + leases + policies, without HTTP.

``server.py`` maps requests onto these methods; tests and the simulator can
drive them directly. Everything here runs on the event loop thread; only
LMDB I/O runs on the tier's threads, so the index needs no locks.

Entry life cycle::

    offer --want--> put --> pending (pages held, invisible) --commit--> committed
                                |  expires after pending_ttl_s        |  LMDB (write-through) + index
                                v                                     v
                             reclaimed                 RAM eviction: demoted (stays on disk)
                                                       capacity: deleted, leaf-first

Write-through to LMDB at commit is what makes "a restarted server serves
every entry it had committed" true even after SIGKILL; RAM is then a hot
subset, and evicting from RAM is a demotion that costs nothing. Without an
LMDB tier (data_dir = none) RAM eviction deletes, leaf-first.

Safety rules enforced here:
- a pinned entry (lease or in-flight read) is never evicted or overwritten;
  an entry removed while pinned (corruption cascade) keeps its pages until
  the last pin drops, so a stream in progress never sends reused bytes;
- a pending entry pins its parent / container, so they cannot be evicted
  between put and commit;
- every read from LMDB verifies the checksum; a mismatch deletes the entry
  and everything that depends on it and is answered as a miss.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import msgpack
import xxhash

from ..admission import MODEL_PRESETS, ModelShape, PolicyContext, make_admission, make_eviction
from ..protocol.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash, chain_hash, root_hash, tail_hash
from ..protocol.keys import Kind
from ..protocol.namespace import Namespace
from ..protocol.wire import (
    HAVE,
    REASON_QUOTA,
    REJECTED,
    STATUS_CORRUPT,
    STATUS_HAVE,
    STATUS_MISSING,
    STATUS_OK,
    STATUS_PENDING,
    STATUS_REJECTED,
    WANT,
    EntryRef,
    GetItem,
    ItemResult,
    ItemSpec,
    Limits,
    LookupAnswer,
    LookupRequest,
    WireError,
    split_hashes,
)
from .arena import Arena, ArenaFull
from .config import StoreConfig
from .evict_queue import EvictionQueue
from .index import STORE_KEY_BYTES, Entry, Index, IndexInvariantError, node_key, scope, store_key
from .leases import Leases
from .lmdb_tier import LmdbTier, ReadOutcome, StoredRecord, TierDamaged
from .metrics import StoreMetrics
from .tasks import stop_task
from .tenants import Tenants, load_tenants

log = logging.getLogger(__name__)

_COMMITTING = math.inf  # expires_s of a pending entry whose commit is in flight
OPEN_TENANT = "default"  # whom everything belongs to on a store without a tenants file
NAMESPACE_RECORD_OVERHEAD = 64  # bytes charged per namespace beside its encoding (index, LMDB key)


@dataclass(slots=True)
class PutPlan:
    """Where each payload of a put body goes: arena views, or None to skip its bytes."""

    namespace_id: bytes
    sizes: list[int]
    targets: list[list[memoryview] | None]
    results: list[ItemResult]
    entries: list[Entry | None]

    @property
    def keys(self) -> list[bytes]:
        """Wire entry keys of the entries this put reserved, for :meth:`Store.commit`."""
        return [e.wire_key for e in self.entries if e is not None]


@dataclass(slots=True)
class GetSlot:
    status: str
    entry: Entry | None = None
    offset: int = 0
    length: int = 0
    buffer: bytearray | None = None  # when the payload could not be promoted into RAM
    checksum: int = 0
    address: int = 0  # set by prepare_get's map_disk: where the range lies in LMDB's map (pinned)


@dataclass(slots=True)
class GetPlan:
    slots: list[GetSlot] = field(default_factory=list)

    @property
    def payload_bytes(self) -> int:
        return sum(s.length for s in self.slots if s.status == STATUS_OK)


class Store:
    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.monotonic,
                 virtual_payloads: bool = False) -> None:
        """``virtual_payloads``: account for pages but hold no bytes (the trace simulator)."""
        self.config = config
        self.clock = clock
        self.limits = Limits(max_header_bytes=config.max_header_bytes, max_items=config.max_items,
                             max_lookup_blocks=config.max_lookup_tokens, max_lookup_tokens=config.max_lookup_tokens,
                             max_body_bytes=config.max_body_bytes)
        self.index = Index()
        self.arena = Arena(config.ram_bytes, config.page_bytes, virtual=virtual_payloads)
        self.tier: LmdbTier | None = None
        self.namespaces: dict[bytes, Namespace] = {}
        self._roots: dict[bytes, BlockHash] = {}  # namespace id -> h_0
        self.pending: dict[bytes, Entry] = {}
        self.ram_queue = EvictionQueue()  # committed, in RAM and on disk: RAM drop is free
        self.delete_queue = EvictionQueue()  # committed leaves: candidates for deletion
        self.leases = Leases(self._unpin, config.max_leases_per_tenant)
        ctx = PolicyContext(shape_of=self.shape_of, filter_bytes=config.sighting_filter_bytes)
        kv_policy = make_admission(config.kv_admission, ctx)
        self.admission = {Kind.BLOCK: kv_policy, Kind.TAIL: kv_policy,
                          Kind.STATE: make_admission(config.state_admission, ctx)}
        self.eviction = make_eviction(config.eviction, ctx)
        self._shapes: dict[bytes, ModelShape | None] = {}
        self.metrics = StoreMetrics(self.index, self._gauges)
        self._doomed: list[bytes] = []  # deleted from the index, still to delete from LMDB
        # Offered and wanted, per tenant, oldest first: admitted at put without asking again.
        # At most max_offers_per_tenant each (a tenant flooding offers forgets its own oldest).
        self._wanted: dict[str, OrderedDict[bytes, float]] = {}
        self._sweeper: asyncio.Task[None] | None = None
        self._prefault: asyncio.Task[bool] | None = None
        self.tenants: Tenants | None = load_tenants(config.tenants_file) if config.tenants_file else None
        # Payload bytes each tenant holds, committed plus pending (a quota must
        # count what is already promised), kept where entries are taken and freed.
        self.tenant_bytes: dict[str, int] = {}
        self.tenant_namespaces: dict[str, int] = {}  # namespaces per owner (owner_of)
        # In a cluster a block usually lives on another node than its parent
        # (protocol/placement.py), so prefix closure holds per cluster, not per
        # node: a block or tail may name a parent this node does not hold.
        self.foreign_parents = bool(config.peer_urls or config.peers_dns)
        # Cluster hooks (store/replication.py): called with each entry a get served.
        self.read_hooks: list[Callable[[Entry], None]] = []
        self._unanchored: set[bytes] = set()  # pending keys whose parent was another node's: nothing pinned
        self.replica_keys: set[bytes] = set()  # entries taken as another node's replicas (store/replication.py)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        path = self.config.lmdb_path
        if path is not None:
            self.tier = LmdbTier(path, self.config.disk_bytes, sync=self.config.lmdb_sync,
                                 max_pins=self.config.nixl_map_txns, keep_damaged=self.config.keep_damaged_lmdb)
            for _ in self.tier.resets:
                self.metrics.lmdb_resets.inc()
            try:
                await self._load_from_disk()
            except BaseException:
                self.tier.close()
                self.tier = None
                raise
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._prefault = asyncio.create_task(asyncio.to_thread(self.arena.prefault))

    async def close(self) -> None:
        if self._prefault is not None:
            await self._prefault
        await stop_task(self._sweeper)
        if self.tier is not None:
            await self._flush_deletes()
            self.tier.close()
            self.tier = None

    async def _load_from_disk(self) -> None:
        """Rebuild the index from LMDB's records. Nothing read back is trusted: a namespace must
        decode within the protocol's bounds and hash to its own id, and every record's key is
        re-derived from its contents (parent, tokens and extra keys; a snapshot's p(t) from its
        container's tokens) and its sizes checked against its namespace, exactly as a put is
        checked. A record that fails is dropped, so a flipped byte on disk is a miss, never an
        entry answering for tokens it does not hold."""
        assert self.tier is not None
        started = time.perf_counter()
        scan = await asyncio.to_thread(self.tier.scan)
        if scan.damage is not None:
            await self._reset_tier(f"scan failed: {scan.damage}")
            return
        for ns_id, encoded in scan.namespaces.items():
            try:
                ns = Namespace.from_wire(msgpack.unpackb(encoded, raw=False))
                self._check_namespace(ns)
            except Exception as err:
                log.warning("dropping namespace record %s: %s", ns_id.hex(), err)
                continue
            if ns.id != ns_id:
                log.warning("dropping namespace record %s: it encodes namespace %s", ns_id.hex(), ns.id.hex())
                continue
            self._add_namespace(ns)
        # Parents before children: blocks by start, then tails, then snapshots.
        order = {Kind.BLOCK: 0, Kind.TAIL: 1, Kind.STATE: 2}
        records = [r for r in scan.records if len(r.key) == STORE_KEY_BYTES and r.key[0] in order]
        dropped = list(scan.broken) + [r.key for r in scan.records if len(r.key) != STORE_KEY_BYTES or r.key[0] not in order]
        records.sort(key=lambda r: (order[Kind(r.key[0])], r.start))
        for r in records:
            kind = Kind(r.key[0])
            e = Entry(key=r.key, kind=kind, hash=BlockHash(r.key[-HASH_BYTES:]), namespace_id=r.namespace_id,
                      parent=BlockHash(r.parent) if r.parent else None, start=r.start, tokens=r.tokens,
                      extra=r.extra, container=r.container, boundary=r.boundary, size=r.size,
                      checksum=r.checksum, on_disk=True, origin=r.origin)
            if not self._rederives(e) or not self._attachable(e):
                dropped.append(r.key)
                continue
            self.index.insert(e)
            self._charge(e, 1)
        for e in self.index.entries.values():
            e.priority = self.eviction.priority(e, 0.0)
            if e.is_leaf:
                self.delete_queue.update(e, e.priority)
        if dropped:
            log.warning("dropping %d LMDB entries whose parent, container or record is gone", len(dropped))
            self._doomed.extend(dropped)
            await self._flush_deletes()
        self._enforce_disk_budget(0)
        log.info("loaded %d entries (%d bytes) from %s in %.2fs", len(self.index.entries),
                 self.index.disk_bytes(), self.tier.path, time.perf_counter() - started)

    def _rederives(self, e: Entry) -> bool:
        """Whether a record read back from disk is what a put of it would have been: its key is
        its namespace's, its hash follows from its contents, its sizes from its namespace."""
        ns = self.namespaces.get(e.namespace_id)
        if ns is None or e.key != store_key(ns.id, e.kind, e.hash) or e.size <= 0 or e.checksum >= 1 << 64:
            return False
        try:
            if e.kind is Kind.STATE:
                c = self.index.get(e.container or b"")
                if c is None or c.namespace_id != ns.id or c.kind is Kind.STATE:
                    return False
                self._check_shape(ns, ItemSpec(kind=e.kind, hash=e.hash, size=e.size), "")
                return self._snapshot_hash(c, e.boundary) == e.hash
            if e.parent is None or len(e.parent) != HASH_BYTES or e.container is not None:
                return False
            self._check_shape(ns, ItemSpec(kind=e.kind, hash=e.hash, size=e.size, parent=e.parent,
                                           tokens=e.tokens, extra=e.extra), "")
        except WireError:
            return False
        return True

    @staticmethod
    def _snapshot_hash(c: Entry, boundary: int) -> BlockHash | None:
        """p(boundary) of a snapshot registered in container ``c``; None outside its range."""
        if not c.start < boundary <= c.end:
            return None
        assert c.parent is not None
        off = boundary - c.start
        return c.hash if boundary == c.end else tail_hash(c.parent, c.tokens[: off * TOKEN_BYTES], c.extra)

    def _attachable(self, e: Entry) -> bool:
        if e.kind is Kind.STATE:
            c = self.index.get(e.container or b"")
            return c is not None and c.start < e.boundary <= c.end
        assert e.parent is not None
        if e.parent == self._roots.get(e.namespace_id):
            return e.start == 0
        p = self.index.get_block(e.namespace_id, e.parent)
        if p is None and self.foreign_parents:  # the parent lives on another node
            ns = self.namespaces.get(e.namespace_id)
            return ns is not None and e.start > 0 and e.start % ns.block_tokens == 0
        return p is not None and p.end == e.start

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.sweep()
                await self._flush_deletes()
            except Exception:  # the sweeper must survive anything; it is housekeeping
                log.exception("sweeper iteration failed")

    def sweep(self) -> None:
        """Expire leases and uncommitted puts, forget stale offers."""
        now = self.clock()
        self.leases.expire(now)
        for key, e in list(self.pending.items()):
            if e.expires_s <= now:
                self._drop_pending(e)
                self.metrics.evictions.labels(e.metric_kind, "expired").inc()
        for owner, wanted in list(self._wanted.items()):
            while wanted and next(iter(wanted.values())) <= now:  # oldest first: same TTL for all
                wanted.popitem(last=False)
            if not wanted:
                del self._wanted[owner]

    async def flush_deletes(self) -> None:
        """Delete from LMDB what was deleted from the index (the sweeper also does it each second)."""
        await self._flush_deletes()

    async def _flush_deletes(self) -> None:
        if self.tier is not None and self._doomed:
            doomed, self._doomed = self._doomed, []
            epoch = self.tier.epoch
            try:
                await self.tier.delete(doomed)
            except TierDamaged as err:
                if self.tier.epoch == epoch:  # not already reset under this write
                    await self._reset_tier(f"delete failed: {err}")

    async def _reset_tier(self, reason: str) -> None:
        """LMDB met damage it cannot work around: drop every entry from the index (they are all
        written through, so none would survive the reset), set the environment aside and go on
        empty. Loud: an error log line (lmdb_tier.py) and ``prefixstore_lmdb_resets_total``.
        Namespaces stay registered (they are written to the new environment again)."""
        assert self.tier is not None
        dropped = self._drop_all("damaged")
        self._doomed.clear()
        self.metrics.lmdb_resets.inc()
        await self.tier.reset(reason)
        log.error("LMDB tier reset (%s): %d entries dropped; serving on from an empty tier", reason, dropped)
        for ns in list(self.namespaces.values()):
            try:
                await self.tier.put_namespace(ns.id, ns.encode())
            except Exception:  # a namespace that is not persisted is registered again by its client
                log.exception("re-writing namespace %s after the LMDB reset failed", ns.id.hex())

    # ------------------------------------------------------------ namespaces

    def owner_of(self, ns: Namespace) -> str:
        """Whom a namespace's resources are counted against (namespaces, leases, offers, quota):
        its tenant, or one owner for all on a store without a tenants file."""
        return ns.tenant if self.tenants is not None else OPEN_TENANT

    def _check_namespace(self, ns: Namespace) -> None:
        """What this store can hold of a namespace the protocol accepts. Raises WireError."""
        limit = self.config.max_body_bytes
        if ns.block_bytes > limit:
            raise WireError("namespace.kv", f"a block is {ns.block_bytes} bytes, more than max_body_bytes={limit}")
        if ns.state.snapshot_bytes > limit:
            raise WireError("namespace.state",
                            f"a snapshot is {ns.state.snapshot_bytes} bytes, more than max_body_bytes={limit}")

    @staticmethod
    def namespace_charge(ns: Namespace) -> int:
        """Bytes a registered namespace is charged to its tenant's quota (its record, kept for good)."""
        return len(ns.encode()) + NAMESPACE_RECORD_OVERHEAD

    def _add_namespace(self, ns: Namespace) -> None:
        owner = self.owner_of(ns)
        self.namespaces[ns.id] = ns
        self._roots[ns.id] = root_hash(ns)
        self.tenant_namespaces[owner] = self.tenant_namespaces.get(owner, 0) + 1
        self.tenant_bytes[ns.tenant] = self.tenant_bytes.get(ns.tenant, 0) + self.namespace_charge(ns)

    def _remove_namespace(self, ns: Namespace) -> None:
        owner = self.owner_of(ns)
        del self.namespaces[ns.id]
        del self._roots[ns.id]
        self._shapes.pop(ns.id, None)
        self.tenant_namespaces[owner] -= 1
        self.tenant_bytes[ns.tenant] -= self.namespace_charge(ns)

    async def register_namespace(self, ns: Namespace) -> bytes:
        """Register (idempotent). Bounded per owner (max_namespaces_per_tenant) and charged to the
        tenant's quota like entries: a namespace is kept in memory and on disk for good."""
        ns_id = ns.id
        if ns_id in self.namespaces:
            return ns_id
        self._check_namespace(ns)
        owner = self.owner_of(ns)
        held = self.tenant_namespaces.get(owner, 0)
        if held >= self.config.max_namespaces_per_tenant:
            raise WireError("namespace", f"tenant {owner!r} already has {held} namespaces, "
                            f"max_namespaces_per_tenant={self.config.max_namespaces_per_tenant}", 403)
        quota = self.quota_of(ns)
        charge = self.namespace_charge(ns)
        if quota is not None and self.tenant_bytes.get(ns.tenant, 0) + charge > quota:
            self.metrics.quota_rejections.labels(ns.tenant).inc()
            raise WireError("quota", f"tenant {ns.tenant!r} would exceed its quota of {quota} bytes with this "
                            f"namespace's record ({charge} bytes)", 413)
        self._add_namespace(ns)  # before the write: concurrent registrations count against the bound
        if self.tier is not None:
            try:
                await self.tier.put_namespace(ns_id, ns.encode())
            except TierDamaged as err:
                await self._reset_tier(f"namespace write failed: {err}")  # writes every namespace again
            except BaseException:
                if self.namespaces.get(ns_id) is ns:
                    self._remove_namespace(ns)
                raise
        return ns_id

    def held_by(self, owner: str) -> dict[str, int]:
        """What one owner (owner_of: a tenant, or everyone on an open store) makes the store hold:
        namespaces, leases, remembered offers, and bytes charged to its quota."""
        return {"namespaces": self.tenant_namespaces.get(owner, 0), "leases": self.leases.held_by(owner),
                "offers": len(self._wanted.get(owner, ())), "bytes": self.tenant_bytes.get(owner, 0)}

    def entry(self, ns_id: bytes, key: bytes) -> Entry | None:
        """The committed entry of wire key ``key`` in namespace ``ns_id`` (introspection, tests)."""
        return self.index.get(scope(ns_id, key))

    def pending_entry(self, ns_id: bytes, key: bytes) -> Entry | None:
        """The uncommitted (put, not committed) entry of ``key`` in ``ns_id``."""
        return self.pending.get(scope(ns_id, key))

    def namespace(self, ns_id: bytes) -> Namespace:
        ns = self.namespaces.get(ns_id)
        if ns is None:
            raise WireError("ns", f"unknown namespace {ns_id.hex()}; register it with POST /v1/namespaces", 404)
        return ns

    def _charge(self, e: Entry, sign: int) -> None:
        ns = self.namespaces.get(e.namespace_id)
        if ns is not None:
            self.tenant_bytes[ns.tenant] = self.tenant_bytes.get(ns.tenant, 0) + sign * e.size

    def quota_of(self, ns: Namespace) -> int | None:
        return self.tenants.quota_of(ns.tenant) if self.tenants is not None else None

    def block_tokens_of(self, ns_id: bytes) -> int:
        return self.namespace(ns_id).block_tokens

    def shape_of(self, ns_id: bytes) -> ModelShape | None:
        """The model shape FLOP-aware eviction ranks by: a preset named by the
        namespace's model, else one derived from its layouts."""
        if ns_id not in self._shapes:
            ns = self.namespaces.get(ns_id)
            shape = None
            if ns is not None:
                shape = MODEL_PRESETS.get(ns.model) or ModelShape(
                    name=ns.model, hidden_size=max(1, ns.kv.num_heads * ns.kv.head_dim),
                    num_attention_layers=ns.kv.num_layers, num_linear_layers=ns.state.num_layers,
                    num_kv_heads=ns.kv.num_heads, head_dim=ns.kv.head_dim, kv_components=ns.kv.num_components,
                    kv_dtype=ns.kv.dtype, state_bytes_per_layer=ns.state.layer_bytes,
                    linear_flops_per_token=8 * max(1, ns.kv.num_heads * ns.kv.head_dim) ** 2)
            self._shapes[ns_id] = shape
        return self._shapes[ns_id]

    # ------------------------------------------------------------ lookup

    def lookup(self, req: LookupRequest) -> LookupAnswer:
        """Longest token-exact match (DESIGN §5). Creates a lease when asked; changes nothing else."""
        ns = self.namespace(req.namespace_id)
        now = self.clock()
        self.leases.expire(now)
        m = self.index.match(req.namespace_id, self._roots[req.namespace_id], ns.block_tokens, req.hashes,
                             req.tokens, self.config.max_child_scan, dict(req.extras) if req.extras else None)
        hint = m.kv_tokens if ns.has_state and m.kv_tokens > m.state_tokens else 0
        self._count_lookup(req, ns, m.matched_blocks, m.kv_tokens, hint, (m.child or m.last_block, m.snapshot), now)
        lease_id = None
        if req.lease and m.kv_tokens:
            held: list[Entry] = []
            for e in (m.last_block, m.child, m.snapshot):
                if e is not None and e not in held:
                    held.append(e)
            if m.snapshot is not None:
                c = self.index.get(m.snapshot.container or b"")
                if c is not None and c not in held:
                    held.append(c)
            lease_id = self.leases.grant(held, now, self.config.lease_ttl_s, owner=self.owner_of(ns))
        tiers = None
        if req.locations and m.matched_blocks:
            tiers = bytes(0 if (e := self.index.get_block(ns.id, h)) is not None and e.pages is not None else 1
                          for h in split_hashes(req.hashes[: m.matched_blocks * HASH_BYTES]))
        n = req.num_tokens
        self.metrics.lookups.inc()
        self.metrics.lookup_tokens.labels("kv", "hit").inc(m.kv_tokens)
        self.metrics.lookup_tokens.labels("kv", "miss").inc(n - m.kv_tokens)
        if ns.has_state:
            self.metrics.lookup_tokens.labels("state", "hit").inc(m.state_tokens)
            self.metrics.lookup_tokens.labels("state", "miss").inc(n - m.state_tokens)
        return LookupAnswer(
            num_tokens=n, matched_blocks=m.matched_blocks, kv_tokens=m.kv_tokens, state_tokens=m.state_tokens,
            checkpoint_hint=hint, block_bytes=ns.block_bytes,
            child=_ref(m.child, m.child_usable) if m.child is not None else None,
            snapshot=_ref(m.snapshot, m.state_tokens) if m.snapshot is not None else None,
            lease_id=lease_id, lease_ttl_s=self.config.lease_ttl_s if lease_id else 0.0, block_tiers=tiers,
        )

    def release(self, lease_id: bytes) -> bool:
        return self.leases.release(lease_id)

    def _count_lookup(self, req: LookupRequest, ns: Namespace, matched_blocks: int, kv_tokens: int, hint: int,
                      served: tuple[Entry | None, Entry | None], now: float) -> None:
        """What policies learn from a lookup: hits, the junction sighting, misses.

        This only feeds future admission and eviction decisions; it never changes
        what a lookup returns."""
        for e in served:
            if e is not None:
                self.admission[e.kind].on_hit(e.kind, e.key, e.num_hits == 0, now, e.origin)
                self.eviction.on_hit(e, now)
                e.num_hits += 1
        if hint:
            B = ns.block_tokens
            j = kv_tokens // B
            if kv_tokens % B == 0:
                junction = BlockHash(req.hashes[(j - 1) * HASH_BYTES : j * HASH_BYTES])
            else:
                parent = BlockHash(req.hashes[(j - 1) * HASH_BYTES : j * HASH_BYTES]) if j else self._roots[ns.id]
                junction = tail_hash(parent, req.tokens[j * B * TOKEN_BYTES : kv_tokens * TOKEN_BYTES],
                                     dict(req.extras).get(j, b""))
            self.admission[Kind.STATE].on_sighting(Kind.STATE, store_key(ns.id, Kind.STATE, junction), now)
            self.eviction.on_miss(Kind.STATE, ns.id + junction, now)
        if matched_blocks < req.num_blocks:
            start = matched_blocks * HASH_BYTES
            self.eviction.on_miss(Kind.BLOCK, ns.id + req.hashes[start : start + HASH_BYTES], now)

    # ------------------------------------------------------------ offer / put / commit

    def _check_shape(self, ns: Namespace, item: ItemSpec, ctx: str) -> None:
        """Everything about an item that does not depend on what is stored. Raises WireError."""
        B = ns.block_tokens
        if item.kind is Kind.STATE:
            if not ns.has_state:
                raise WireError(f"{ctx}kind", "this namespace has no state layout, so it holds no snapshots")
            if item.size != ns.state.snapshot_bytes:
                raise WireError(f"{ctx}size", f"a snapshot of this namespace is {ns.state.snapshot_bytes} bytes, got {item.size}")
            return
        n = item.num_tokens
        if item.kind is Kind.BLOCK and n != B:
            raise WireError(f"{ctx}tokens", f"a block holds exactly {B} tokens, got {n}")
        if item.kind is Kind.TAIL and not 0 < n < B:
            raise WireError(f"{ctx}tokens", f"a tail holds 1 to {B - 1} tokens, got {n}")
        if ns.kv.token_bytes == 0:
            raise WireError(f"{ctx}kind", "this namespace has no KV layout")
        expected = ns.kv.payload_bytes(n)
        if item.size != expected:
            raise WireError(f"{ctx}size", f"{n} tokens of this namespace's KV are {expected} bytes, got {item.size}")
        assert item.parent is not None
        link = chain_hash if item.kind is Kind.BLOCK else tail_hash
        if link(item.parent, item.tokens, item.extra) != item.hash:
            raise WireError(f"{ctx}hash", "does not equal the hash of parent, tokens and extra (protocol/hashing.py)")

    def _find(self, key: bytes, batch: dict[bytes, Entry]) -> Entry | None:
        return batch.get(key) or self.pending.get(key) or self.index.get(key)

    def _resolve(self, ns_id: bytes, item: ItemSpec, key: bytes, batch: dict[bytes, Entry],
                 now: float, ctx: str) -> Entry | str:
        """A new (uncommitted) entry for the item, or the reason it cannot be taken."""
        if item.kind is Kind.STATE:
            assert item.container is not None
            container = scope(ns_id, item.container)
            c = self._find(container, batch)
            if c is None:
                return "container not stored"
            expected = self._snapshot_hash(c, item.boundary)
            if expected is None:
                raise WireError(f"{ctx}boundary", f"{item.boundary} is outside the container's token range "
                                f"({c.start}, {c.end}]")
            if expected != item.hash:
                raise WireError(f"{ctx}hash", f"does not equal p({item.boundary}) of the container's tokens")
            return Entry(key=key, kind=Kind.STATE, hash=item.hash, namespace_id=ns_id, parent=None, start=0,
                         tokens=b"", extra=b"", container=container, boundary=item.boundary,
                         size=item.size, checksum=item.checksum or 0, last_access_s=now, origin=item.origin)
        assert item.parent is not None
        if item.parent == self._roots[ns_id]:
            start = 0
        else:
            p = self._find(store_key(ns_id, Kind.BLOCK, item.parent), batch)
            if p is not None:
                start = p.end
            elif p is None and self.foreign_parents and item.start is not None:
                # Cluster: the parent is another node's; the client says where the block starts.
                B = self.namespace(ns_id).block_tokens
                if item.start <= 0 or item.start % B:
                    raise WireError(f"{ctx}start", f"{item.start} is not a positive multiple of the block size {B}")
                start = item.start
            else:
                return "parent not stored"
        return Entry(key=key, kind=item.kind, hash=item.hash, namespace_id=ns_id, parent=item.parent, start=start,
                     tokens=item.tokens, extra=item.extra, container=None, boundary=0, size=item.size,
                     checksum=item.checksum or 0, last_access_s=now)

    def _triage(self, ns_id: bytes, items: Sequence[ItemSpec], for_put: bool
                ) -> tuple[list[ItemResult], list[Entry | None]]:
        """First pass of offer and put: validate everything, allocate nothing."""
        ns = self.namespace(ns_id)
        owner = self.owner_of(ns)
        now = self.clock()
        quota = self.quota_of(ns)
        taken = self.tenant_bytes.get(ns.tenant, 0)  # plus what this batch takes, below
        batch: dict[bytes, Entry] = {}
        results: list[ItemResult] = []
        new: list[Entry | None] = []
        for i, item in enumerate(items):
            ctx = f"items[{i}]."
            self._check_shape(ns, item, ctx)
            if for_put and item.checksum is None:
                raise WireError(f"{ctx}checksum", "a put item needs the xxh3-64 of its payload")
            key = store_key(ns_id, item.kind, item.hash)  # scoped: only this namespace's entries answer
            if self._find(key, batch) is not None:
                results.append(ItemResult(HAVE if not for_put else STATUS_HAVE))
                new.append(None)
                continue
            got = self._resolve(ns_id, item, key, batch, now, ctx)
            if isinstance(got, str):
                results.append(ItemResult(REJECTED, got))
                new.append(None)
                continue
            if self.arena.pages_for(item.size) > self.arena.num_pages:
                results.append(ItemResult(REJECTED, "larger than the RAM arena"))
                new.append(None)
                continue
            if quota is not None and taken + item.size > quota:
                results.append(ItemResult(REJECTED, REASON_QUOTA))
                new.append(None)
                self.metrics.quota_rejections.labels(ns.tenant).inc()
                continue
            offers = self._wanted.get(owner) if for_put else None
            wanted = offers is not None and offers.pop(key, None) is not None
            if not wanted and not self.admission[item.kind].admit(item.kind, key, item.size, now, item.origin):
                results.append(ItemResult(REJECTED, "admission"))
                new.append(None)
                continue
            batch[key] = got
            taken += item.size
            results.append(ItemResult(WANT))
            new.append(got)
        return results, new

    def offer(self, ns_id: bytes, items: Sequence[ItemSpec]) -> list[ItemResult]:
        """Per item: want / have / rejected. Bytes move only for wanted items."""
        results, _ = self._triage(ns_id, items, for_put=False)
        now = self.clock()
        wanted = self._wanted.setdefault(self.owner_of(self.namespace(ns_id)), OrderedDict())
        for item, r in zip(items, results):
            self.metrics.admission.labels(item.kind.metric_kind, r.status).inc()
            if r.status == WANT:
                key = store_key(ns_id, item.kind, item.hash)
                wanted.pop(key, None)  # a repeat offer moves to the back, so expiry stays in order
                wanted[key] = now + self.config.pending_ttl_s
        while len(wanted) > self.config.max_offers_per_tenant:
            wanted.popitem(last=False)  # the owner's oldest: its put will ask admission again
        return results

    def plan_put(self, ns_id: bytes, items: Sequence[ItemSpec]) -> PutPlan:
        """Decide each item and reserve arena pages for the ones taken."""
        results, new = self._triage(ns_id, items, for_put=True)
        now = self.clock()
        # Pin every anchor (parent / container) before allocating: making room
        # may evict, and must not evict what this batch builds on.
        in_batch = {e.key: e for e in new if e is not None}
        anchors: list[Entry | None] = []
        for e in new:
            anchor_key = self._anchor_key(e) if e is not None else None
            anchor = (in_batch.get(anchor_key) or self._find(anchor_key, {})) if anchor_key else None
            if anchor is not None:
                anchor.pins += 1  # held until the entry commits or is dropped
            elif e is not None and anchor_key is not None:
                self._unanchored.add(e.key)  # a cluster block whose parent is another node's
            anchors.append(anchor)
        targets: list[list[memoryview] | None] = []
        failed: set[bytes] = set()
        for i, (item, e) in enumerate(zip(items, new)):
            if e is None:
                targets.append(None)
                decision = HAVE if results[i].status == STATUS_HAVE else REJECTED
                self.metrics.admission.labels(item.kind.metric_kind, decision).inc()
                continue
            dep = self._anchor_key(e)
            pages = None if dep in failed else self._allocate(e.size)
            if pages is None:
                failed.add(e.key)
                self._unanchored.discard(e.key)
                anchor = anchors[i]
                if anchor is not None:
                    self._unpin(anchor)
                results[i] = ItemResult(STATUS_REJECTED, "parent not stored" if dep in failed else
                                        "RAM arena full of pinned or uncommitted entries")
                new[i] = None
                targets.append(None)
                self.metrics.admission.labels(item.kind.metric_kind, REJECTED).inc()
                continue
            e.pages = pages
            e.expires_s = now + self.config.pending_ttl_s
            self.pending[e.key] = e
            self._charge(e, 1)
            targets.append(list(self.arena.runs(pages, 0, e.size)))
            results[i] = ItemResult(STATUS_PENDING)
            self.metrics.admission.labels(item.kind.metric_kind, WANT).inc()
        return PutPlan(namespace_id=ns_id, sizes=[it.size for it in items], targets=targets,
                       results=results, entries=new)

    def abort_put(self, plan: PutPlan) -> None:
        """The body did not arrive whole: forget every entry this put reserved."""
        for e in plan.entries:
            if e is not None and self.pending.get(e.key) is e:
                self._drop_pending(e)

    def verify_put(self, plan: PutPlan) -> None:
        """After the body arrived: drop items whose bytes do not match their checksum."""
        for i, e in enumerate(plan.entries):
            if e is None or self.pending.get(e.key) is not e:
                continue
            assert e.pages is not None
            if not self.arena.virtual and self.arena.checksum(e.pages, 0, e.size) != e.checksum:
                self._drop_pending(e)
                plan.entries[i] = None
                plan.results[i] = ItemResult(STATUS_REJECTED, "payload does not match its checksum")
                self.metrics.checksum_failures.labels("network").inc()

    def verify_pending(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[list[ItemResult], int]:
        """The NIXL path's verify_put: payloads were WRITTEN into reserved pages, not streamed.
        Per key: pending (its pages hold bytes matching its checksum), rejected (dropped: they do
        not), or missing; plus the payload bytes verified. ``keys`` are wire entry keys."""
        out: list[ItemResult] = []
        received = 0
        for key in keys:
            e = self.pending.get(scope(ns_id, key))
            if e is None or e.pages is None or e.expires_s == _COMMITTING:
                out.append(ItemResult(STATUS_MISSING, "not reserved, expired, or committing"))
                continue
            if self.arena.checksum(e.pages, 0, e.size) != e.checksum:
                self._drop_pending(e)
                out.append(ItemResult(STATUS_REJECTED, "payload does not match its checksum"))
                self.metrics.checksum_failures.labels("network").inc()
                continue
            received += e.size
            out.append(ItemResult(STATUS_PENDING))
        return out, received

    def _anchor_key(self, e: Entry) -> bytes | None:
        if e.kind is Kind.STATE:
            return e.container
        assert e.parent is not None
        return None if e.parent == self._roots.get(e.namespace_id) else e.parent_key

    def _drop_pending(self, e: Entry) -> None:
        del self.pending[e.key]
        self._charge(e, -1)
        e.dead = True
        if e.pages is not None:
            self.arena.free(e.pages)
            e.pages = None
        anchor_key = self._anchor_key(e)
        anchor = self._find(anchor_key, {}) if anchor_key else None
        if e.key in self._unanchored:
            self._unanchored.discard(e.key)
        elif anchor is not None:
            self._unpin(anchor)

    async def commit(self, ns_id: bytes, keys: Sequence[bytes]) -> list[ItemResult]:
        """Make pending entries visible: persist them (write-through), then index them.
        ``keys`` are wire entry keys (kind || hash) of namespace ``ns_id``."""
        self.namespace(ns_id)
        results: list[ItemResult] = [ItemResult(STATUS_MISSING, "not put, or expired")] * len(keys)
        batch: list[tuple[int, Entry]] = []
        for i, wire_key in enumerate(keys):
            key = scope(ns_id, wire_key)
            e = self.pending.get(key)
            if e is None:
                if self.index.get(key) is not None:
                    results[i] = ItemResult(STATUS_HAVE)
                continue
            if e.expires_s == _COMMITTING:
                results[i] = ItemResult(STATUS_PENDING, "a commit of this entry is in flight")
                continue
            e.expires_s = _COMMITTING
            batch.append((i, e))
        if not batch:
            return results
        # Parents before children whatever order the client listed them in.
        order = {Kind.BLOCK: 0, Kind.TAIL: 1, Kind.STATE: 2}
        batch.sort(key=lambda ie: (order[ie[1].kind], ie[1].start))
        if self.tier is not None:
            room = self._enforce_disk_budget(sum(e.size for _, e in batch))
            if not room:
                for i, e in batch:
                    self._drop_pending(e)
                    results[i] = ItemResult(STATUS_REJECTED, "LMDB tier full of pinned entries")
                return results
            doomed, self._doomed = self._doomed, []
            puts = [(self._record(e), list(self.arena.runs(e.pages or [], 0, e.size))) for _, e in batch]
            epoch = self.tier.epoch
            try:
                await self.tier.write(puts, doomed)
                if self.tier.epoch != epoch:  # reset meanwhile: written to the environment set aside
                    raise TierDamaged("the tier was reset while this commit was written")
            except Exception as err:
                log.exception("LMDB write failed; %d entries not committed", len(batch))
                for i, e in batch:
                    if self.pending.get(e.key) is e:
                        self._drop_pending(e)
                    results[i] = ItemResult(STATUS_REJECTED, f"disk write failed: {type(err).__name__}")
                if not isinstance(err, TierDamaged):
                    self._doomed.extend(doomed)  # still to delete
                elif self.tier.epoch == epoch:  # not already reset under this write
                    await self._reset_tier(f"commit failed: {err}")
                return results
        now = self.clock()
        for i, e in batch:
            if self.pending.get(e.key) is not e:  # dropped while the write was in flight
                results[i] = ItemResult(STATUS_REJECTED, "dropped before commit")
                self._doomed.append(e.key)
                continue
            if not self._attachable(e) or e.key in self.index.entries:
                gone = e.key not in self.index.entries
                self._drop_pending(e)
                if gone:
                    self._doomed.append(e.key)
                results[i] = ItemResult(STATUS_REJECTED, "parent or container gone") if gone else ItemResult(STATUS_HAVE)
                continue
            del self.pending[e.key]
            e.on_disk = self.tier is not None
            e.last_access_s = now
            self.index.insert(e)
            self.eviction.on_store(e, now)
            anchor_key = self._anchor_key(e)
            pinned = e.key not in self._unanchored
            self._unanchored.discard(e.key)
            if anchor_key is not None:
                anchor = self.index.get(anchor_key)
                if anchor is not None:
                    self.delete_queue.discard(anchor)  # it has a dependant now
                    if pinned:
                        self._unpin(anchor)
            self._requeue(e, now)
            results[i] = ItemResult(STATUS_OK)
        return results

    def _record(self, e: Entry) -> StoredRecord:
        return StoredRecord(key=e.key, namespace_id=e.namespace_id, parent=e.parent, start=e.start,
                            tokens=e.tokens, extra=e.extra, container=e.container, boundary=e.boundary, size=e.size,
                            checksum=e.checksum, origin=e.origin)

    # ------------------------------------------------------------ get

    def _byte_range(self, ns: Namespace, e: Entry, item: GetItem, ctx: str) -> tuple[int, int]:
        if item.layer_start == 0 and item.layer_end is None:
            return 0, e.size
        try:
            return ns.payload_range(e.kind is Kind.STATE, e.num_tokens, item.layer_start, item.layer_end)
        except ValueError as err:
            raise WireError(f"{ctx}.layer_end", str(err)) from None

    async def prepare_get(self, ns_id: bytes, items: Sequence[GetItem],
                          map_disk: Callable[[list[GetSlot]], Awaitable[list[str | None]]] | None = None
                          ) -> GetPlan:
        """Pin every requested entry and bring disk-only ones into RAM (checksum verified).

        ``map_disk`` (the NIXL map READ, store/nixl_target.py) is first offered the disk-only
        slots; per slot it answers a ReadOutcome (OK: it set ``slot.address`` and
        ``slot.checksum`` and keeps the value readable in place; MISSING / CORRUPT: handled like
        a failed promotion) or None (promote it as usual).

        The caller streams the plan and must call :meth:`finish_get`."""
        ns = self.namespace(ns_id)
        plan = GetPlan()
        total = 0
        try:
            for i, item in enumerate(items):
                e = self.index.get(scope(ns_id, item.key))
                if e is None:
                    plan.slots.append(GetSlot(STATUS_MISSING))
                    continue
                offset, length = self._byte_range(ns, e, item, f"items[{i}]")
                total += length
                if total > self.config.max_get_bytes:
                    raise WireError("items", f"asks for more than max_get_bytes={self.config.max_get_bytes}; "
                                    "split the batch", 413)
                e.pins += 1
                plan.slots.append(GetSlot(STATUS_OK, e, offset, length))
        except BaseException:
            self.finish_get(plan)
            raise
        disk: list[GetSlot] = []
        for slot in plan.slots:
            e = slot.entry
            if e is None or e.pages is not None:
                continue
            if e.dead:
                slot.status = STATUS_MISSING
                continue
            disk.append(slot)
        mapped: list[str | None] = list(await map_disk(disk)) if map_disk is not None and disk else []
        mapped += [None] * (len(disk) - len(mapped))
        for slot, outcome in zip(disk, mapped):
            e = slot.entry
            assert e is not None
            if outcome == ReadOutcome.OK:
                continue
            if outcome is not None:
                slot.status = await self._read_failed(e, outcome)
                continue
            if e.pages is not None:  # promoted by a concurrent read meanwhile
                continue
            if e.dead:
                slot.status = STATUS_MISSING
                continue
            status, buffer = await self._load(e)
            slot.status, slot.buffer = status, buffer
        now = self.clock()
        for slot in plan.slots:
            e = slot.entry
            if slot.status != STATUS_OK or e is None:
                continue
            if slot.address:
                pass  # map_disk set its checksum
            elif slot.offset == 0 and slot.length == e.size:
                slot.checksum = e.checksum
            elif slot.buffer is not None:
                slot.checksum = xxhash.xxh3_64_intdigest(memoryview(slot.buffer)[slot.offset : slot.offset + slot.length])
            else:
                assert e.pages is not None
                slot.checksum = self.arena.checksum(e.pages, slot.offset, slot.length)
            e.last_access_s = now
            if not e.dead:
                self._requeue(e, now)
            for hook in self.read_hooks:
                hook(e)
        return plan

    def payload_views(self, slot: GetSlot) -> list[memoryview]:
        assert slot.entry is not None
        if slot.buffer is not None:
            return [memoryview(slot.buffer)[slot.offset : slot.offset + slot.length]]
        assert slot.entry.pages is not None
        return list(self.arena.runs(slot.entry.pages, slot.offset, slot.length))

    def finish_get(self, plan: GetPlan) -> None:
        for slot in plan.slots:
            if slot.entry is not None:
                self._unpin(slot.entry)
                slot.entry = None

    async def _load(self, e: Entry) -> tuple[str, bytearray | None]:
        """Promote a disk-only entry into RAM (or a buffer when RAM is all pinned), verifying it."""
        assert self.tier is not None and e.on_disk
        pages = self._allocate(e.size)
        buffer = None
        if pages is not None:
            dest = list(self.arena.runs(pages, 0, e.size))
        else:
            buffer = bytearray(e.size)
            dest = [memoryview(buffer)]
        outcome = await self.tier.read_into(e.key, e.size, e.checksum, dest)
        if outcome != ReadOutcome.OK:
            if pages is not None:
                self.arena.free(pages)
            return await self._read_failed(e, outcome), None
        if pages is None:
            return STATUS_OK, buffer
        if e.dead or e.pages is not None:  # deleted, or promoted by a concurrent read meanwhile
            copy = bytearray(self.arena.read(pages, e.size)) if e.pages is None else None
            self.arena.free(pages)
            if copy is not None:
                return STATUS_OK, copy
            return STATUS_OK, None
        self.index.set_tier(e, pages, True)
        return STATUS_OK, None

    async def _read_failed(self, e: Entry, outcome: str) -> str:
        """An LMDB read of ``e`` found it missing or corrupt: delete it (and its dependants)."""
        if outcome == ReadOutcome.CORRUPT:
            self.metrics.checksum_failures.labels("disk").inc()
            log.warning("checksum mismatch reading %s from LMDB; deleting it", e.key.hex())
        if not e.dead:
            self._delete(e, "corrupt")
            await self._flush_deletes()
        return STATUS_CORRUPT if outcome == ReadOutcome.CORRUPT else STATUS_MISSING

    # ------------------------------------------------------------ space

    def _allocate(self, size: int) -> list[int] | None:
        """Arena pages for ``size`` bytes, evicting unpinned entries as needed; None if impossible."""
        need = self.arena.pages_for(size)
        if need > self.arena.num_pages:
            return None
        while self.arena.num_free < need:
            if self.tier is not None:
                popped = self.ram_queue.pop(lambda e: e.pins == 0)
                if popped is None:
                    return None
                v, priority = popped
                assert v.pages is not None
                self.arena.free(v.pages)
                self.index.set_tier(v, None, True)
                self.eviction.on_evict(v, priority, self.clock())
                self.metrics.evictions.labels(v.metric_kind, "demoted").inc()
            else:
                popped = self.delete_queue.pop(lambda e: e.pins == 0)
                if popped is None:
                    return None
                self._evict(*popped)
        try:
            return self.arena.allocate(size)
        except ArenaFull:  # pragma: no cover - the loop above guarantees room
            return None

    def _enforce_disk_budget(self, incoming: int) -> bool:
        while self.index.disk_bytes() + incoming > self.config.disk_bytes:
            popped = self.delete_queue.pop(lambda e: e.pins == 0)
            if popped is None:
                return False
            self._evict(*popped)
        return True

    def _evict(self, victim: Entry, priority: float) -> None:
        """Delete a capacity victim (a leaf) and tell the policies."""
        now = self.clock()
        self.eviction.on_evict(victim, priority, now)
        self.admission[victim.kind].on_evict(victim.kind, victim.num_hits, now, victim.origin)
        self._delete(victim, "capacity")

    def _delete(self, e: Entry, reason: str) -> None:
        """Remove ``e`` and everything that depends on it, leaves first."""
        for x in self.index.subtree(e):
            up = self.index.remove(x)
            self._charge(x, -1)
            self.ram_queue.discard(x)
            self.delete_queue.discard(x)
            if x.on_disk:
                self._doomed.append(x.key)
            if x.pins == 0 and x.pages is not None:
                self.arena.free(x.pages)
                x.pages = None
            self.metrics.evictions.labels(x.metric_kind, reason).inc()
            if up is not None and up.committed and up.is_leaf:
                # Its priority from its own last access: becoming a leaf is not a use.
                self.delete_queue.update(up, up.priority)

    def flush(self) -> int:
        """Delete every committed entry (the admin flush); returns how many. Pending puts stay
        pending and are refused at commit ("parent or container gone") when their parent went."""
        return self._drop_all("flushed")

    def _drop_all(self, reason: str) -> int:
        before = len(self.index.entries)
        for e in list(self.index.entries.values()):
            if e.kind is not Kind.STATE and not e.dead and e.key in self.index.entries \
                    and (e.parent == self._roots.get(e.namespace_id)
                         or (e.parent is not None and self.index.get_block(e.namespace_id, e.parent) is None)):
                self._delete(e, reason)
        return before - len(self.index.entries)

    def _unpin(self, e: Entry) -> None:
        e.pins -= 1
        if e.pins < 0:
            raise IndexInvariantError(f"entry {e.key.hex()}: unpinned more often than pinned")
        if e.pins == 0 and e.dead and e.pages is not None and not e.committed and self.pending.get(e.key) is not e:
            self.arena.free(e.pages)
            e.pages = None

    def _requeue(self, e: Entry, now: float) -> None:
        priority = e.priority = self.eviction.priority(e, now)
        if e.pages is not None and e.on_disk:
            self.ram_queue.update(e, priority)
        if e.is_leaf:
            self.delete_queue.update(e, priority)

    # ------------------------------------------------------------ introspection

    def _gauges(self) -> dict[str, float]:
        return {
            "prefixstore_arena_capacity_bytes": self.arena.capacity_bytes,
            "prefixstore_arena_free_bytes": self.arena.num_free * self.arena.page_bytes,
            "prefixstore_leases": len(self.leases),
            "prefixstore_pending_entries": len(self.pending),
            "prefixstore_lmdb_read_txns": self.tier.pinned if self.tier is not None else 0,
        }

    def stats(self) -> dict[str, object]:
        idx = self.index
        return {
            "namespaces": len(self.namespaces),
            "entries": {f"{k}/{t}": n for (k, t), n in sorted(idx.stored_entries.items())},
            "stored_bytes": {f"{k}/{t}": n for (k, t), n in sorted(idx.stored_bytes.items())},
            "arena": {"capacity_bytes": self.arena.capacity_bytes, "page_bytes": self.arena.page_bytes,
                      "free_bytes": self.arena.num_free * self.arena.page_bytes},
            "disk": {"enabled": self.tier is not None, "budget_bytes": self.config.disk_bytes,
                     "payload_bytes": idx.disk_bytes(),
                     "path": str(self.tier.path) if self.tier is not None else None},
            "leases": len(self.leases),
            "pending": len(self.pending),
            "tenants": {name: {"stored_bytes": n, "quota_bytes": self.tenants.quota_of(name) if self.tenants else None}
                        for name, n in sorted(self.tenant_bytes.items())},
            "policies": {"kv_admission": self.admission[Kind.BLOCK].name,
                         "state_admission": self.admission[Kind.STATE].name,
                         "eviction": self.eviction.name},
        }

    def check(self) -> None:
        """Verify the store's invariants (index, arena accounting, queues); raise naming the broken one."""
        self.index.check({node_key(ns_id, h) for ns_id, h in self._roots.items()}, foreign_parents=self.foreign_parents)
        holders = list(self.index.entries.values()) + list(self.pending.values())
        if self.arena.virtual:
            held = sum(-sum(e.pages) for e in holders if e.pages)
            if held > self.arena.num_pages - self.arena.num_free:
                raise IndexInvariantError("arena: more pages held than allocated")
        else:
            used: dict[int, bytes] = {}
            for e in holders:
                for p in e.pages or ():
                    if p in used:
                        raise IndexInvariantError(f"page {p} is held by two entries")
                    used[p] = e.key
            if len(used) > self.arena.num_pages - self.arena.num_free:
                raise IndexInvariantError("arena: more pages held than allocated")
        for e in self.index.entries.values():
            if e.is_leaf and e not in self.delete_queue:
                raise IndexInvariantError(f"entry {e.key.hex()}: a leaf missing from the deletion queue")
            if self.tier is not None and e.pages is not None and e not in self.ram_queue:
                raise IndexInvariantError(f"entry {e.key.hex()}: in RAM but missing from the RAM queue")
            if e.pins < 0:
                raise IndexInvariantError(f"entry {e.key.hex()}: negative pins")
            if self.tier is not None and not e.on_disk:
                raise IndexInvariantError(f"entry {e.key.hex()}: committed but not written through to LMDB")
        owed: dict[str, int] = {}
        owned: dict[str, int] = {}
        for ns in self.namespaces.values():
            owed[ns.tenant] = owed.get(ns.tenant, 0) + self.namespace_charge(ns)
            owned[self.owner_of(ns)] = owned.get(self.owner_of(ns), 0) + 1
        if {t: n for t, n in self.tenant_namespaces.items() if n} != owned:
            raise IndexInvariantError(f"namespace counts {self.tenant_namespaces} differ from those held {owned}")
        for e in holders:
            tenant = self.namespaces[e.namespace_id].tenant
            owed[tenant] = owed.get(tenant, 0) + e.size
        if {t: n for t, n in self.tenant_bytes.items() if n} != owed:
            raise IndexInvariantError(f"tenant bytes {self.tenant_bytes} differ from the entries held {owed}")


def _ref(e: Entry, usable: int) -> EntryRef:
    return EntryRef(key=e.wire_key, num_tokens=e.num_tokens, usable_tokens=usable, size=e.size,
                    tier="ram" if e.pages is not None else "disk")
