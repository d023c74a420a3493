"""The store: a thin facade over services with one job each, without HTTP.

::

    Store ── lookups  LookupService  match, probe, the one function that teaches policies (lookups.py)
          ├─ writes   WritePath      offer, plan_put, verify, commit, restart adoption   (writes.py)
          ├─ reads    ReadPath       prepare_get, promotion from LMDB, finish_get         (reads.py)
          ├─ behind   WriteBehind    committed entries persisted to LMDB behind the commit (behind.py)
          ├─ space    Space          allocation, demotion, eviction, deletion             (space.py)
          ├─ disk     Disk           the LMDB tier, deletions owed to it, damage recovery (disk.py)
          ├─ namespaces Namespaces   records, roots, shapes; bounded registration         (namespaces.py)
          └─ ledger   TenantLedger   bytes, namespaces, quota per tenant                  (ledger.py)
       over  index (index.py), arena (arena.py), leases (leases.py), metrics (metrics.py), policies (admission/)

A service holds references to the parts it uses and never reaches into another service's fields;
the HTTP plane (store/http.py and the route modules) calls the facade's methods. Errors are
:class:`protocol.errors.RequestError` values with a problem and a field, mapped to HTTP status
only by the HTTP plane. Everything here runs on the event loop thread; only LMDB I/O runs on the
tier's threads, so the index needs no locks. docs/design.md ("The store's services") has the map
and the path of a lookup and a save through it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence

from prefixstore.admission import ModelShape, PolicyContext, make_admission, make_eviction
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.probe import LookupReport, ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec, Limits, LookupAnswer, LookupRequest
from .arena import Arena
from .behind import WriteBehind
from .config import StoreConfig
from .disk import Disk
from .index import Entry, Index, IndexInvariantError, scope
from .leases import Leases
from .ledger import OPEN_TENANT, TenantLedger, namespace_charge
from .lmdb_tier import LmdbTier
from .lookups import LookupService
from .metrics import StoreMetrics
from .namespaces import Namespaces
from .reads import GetPlan, GetSlot, MapDisk, ReadPath
from .space import Space
from .tasks import stop_task
from .tenants import Tenants, load_tenants
from .validate import check_namespace
from .puts import PutIntake, PutOrder
from .writes import PutPlan, WritePath

log = logging.getLogger(__name__)


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
        self.metrics = StoreMetrics(self.index, self._gauges, config.model_metrics_per_tenant)
        self.tenants: Tenants | None = load_tenants(config.tenants_file) if config.tenants_file else None
        self.ledger = TenantLedger(self.tenants, self.metrics, config.max_entries)
        for tenant in self.tenants.tenants if self.tenants is not None else ():
            self.metrics.quota_rejections.labels(tenant.name)  # at 0 from start: listed tenants only
        self.metrics.tenant_usage = lambda: [
            (name, n, self.tenants.quota_of(name) if self.tenants is not None else None)
            for name, n in sorted(self.ledger.bytes.items())]
        self.namespaces = Namespaces(config, self.ledger)
        # A secret seed: the sighting filters' bit positions must not be computable by a tenant
        # (admission/sighting.py). The simulator passes none and stays deterministic.
        seed = 0 if virtual_payloads else int.from_bytes(os.urandom(8), "little")
        ctx = PolicyContext(shape_of=self.namespaces.shape_of, filter_bytes=config.sighting_filter_bytes,
                            hash_seed=seed)
        kv_policy = make_admission(config.kv_admission, ctx)
        self.admission = {Kind.BLOCK: kv_policy, Kind.TAIL: kv_policy,
                          Kind.STATE: make_admission(config.state_admission, ctx)}
        self.eviction = make_eviction(config.eviction, ctx)
        self.disk = Disk(config, self.metrics)
        self.space = Space(self.index, self.arena, self.disk, self.namespaces, self.ledger, self.admission,
                           self.eviction, self.metrics, clock, config.disk_bytes, config.max_entries)
        leased_bytes = int(config.max_leased_share * config.ram_bytes) if self.tenants is not None else None
        self.leases = Leases(self.space.unpin, config.max_leases_per_tenant, leased_bytes)
        self.metrics.tenant_leased = lambda: self.leases.bytes_by_owner
        self.behind = WriteBehind(config, self.index, self.arena, self.space, self.disk, self.metrics, clock)
        self.writes = WritePath(config=config, index=self.index, arena=self.arena, namespaces=self.namespaces,
                                ledger=self.ledger, space=self.space, disk=self.disk, behind=self.behind,
                                admission=self.admission, eviction=self.eviction, metrics=self.metrics, clock=clock)
        self.reads = ReadPath(config, self.index, self.arena, self.space, self.disk, self.metrics, clock)
        self.lookups = LookupService(config, self.index, self.namespaces, self.leases, self.ledger, self.admission,
                                     self.eviction, self.metrics, clock)
        self.disk.bind(drop_all=self.space.drop_all, namespaces=lambda: self.namespaces)
        self.replica_keys: set[bytes] = set()  # entries taken as another node's replicas (store/replication.py)
        self._sweeper: asyncio.Task[None] | None = None
        self._prefault: asyncio.Task[bool] | None = None

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self.disk.open()
        if self.disk.tier is not None:
            try:
                await self._load_from_disk()
            except BaseException:
                await self.disk.close()
                raise
        self.behind.start()
        self._sweeper = asyncio.create_task(self._sweep_forever())
        self._prefault = asyncio.create_task(asyncio.to_thread(self.arena.prefault))

    async def close(self) -> None:
        if self._prefault is not None:
            await self._prefault
        await stop_task(self._sweeper)
        await self.behind.close()  # drained: every committed entry is in LMDB before it closes
        await self.disk.close()

    async def _load_from_disk(self) -> None:
        """Rebuild the index from LMDB (every record re-derived: WritePath.adopt)."""
        tier = self.disk.tier
        assert tier is not None
        started = time.perf_counter()
        scan = await self.disk.scan()
        if scan.damage is not None:
            await self.disk.reset(f"scan failed: {scan.damage}")
            return
        for ns_id, encoded in scan.namespaces.items():
            try:  # within the protocol's bounds and this store's limits, like a registration
                ns = Namespace.decode(encoded)
                check_namespace(ns, self.config.max_body_bytes)
            except Exception as err:
                log.warning("dropping namespace record %s: %s", ns_id.hex(), err)
                continue
            if ns.id != ns_id:
                log.warning("dropping namespace record %s: it encodes namespace %s", ns_id.hex(), ns.id.hex())
                continue
            self.namespaces.add(ns)
        dropped = list(scan.broken) + self.writes.adopt(scan.records)
        if dropped:
            log.warning("dropping %d LMDB entries whose parent, container or record is gone or wrong", len(dropped))
            for key in dropped:
                self.disk.doom(key)
            await self.disk.flush()
        self.space.enforce_disk_budget(0)
        self.space.enforce_entry_budget(0)
        log.info("loaded %d entries (%d bytes) from %s in %.2fs", len(self.index.entries),
                 self.index.disk_bytes(), tier.path, time.perf_counter() - started)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            try:
                self.sweep()
                await self.disk.flush()
            except Exception:  # the sweeper must survive anything; it is housekeeping
                log.exception("sweeper iteration failed")

    def sweep(self) -> None:
        """Expire leases and uncommitted puts, forget stale offers."""
        now = self.clock()
        self.leases.expire(now)
        self.writes.sweep(now)

    async def drain_writes(self) -> None:
        """Return once every entry committed so far is in LMDB (durability=write-behind; at once
        otherwise)."""
        await self.behind.drain()

    async def flush_deletes(self) -> None:
        """Delete from LMDB what was deleted from the index (the sweeper also does it each second)."""
        await self.disk.flush()

    # ------------------------------------------------------------ namespaces and tenants

    async def register_namespace(self, ns: Namespace) -> bytes:
        """Register (idempotent). Bounded per owner and charged to the tenant's quota: a namespace
        is kept in memory and on disk for good (store/namespaces.py)."""
        if ns.id in self.namespaces:
            return ns.id
        self.namespaces.admit(ns)
        self.namespaces.add(ns)  # before the write: concurrent registrations count against the bound
        try:
            await self.disk.put_namespace(ns)
        except BaseException:
            if self.namespaces.find(ns.id) is ns:
                self.namespaces.remove(ns)
            raise
        return ns.id

    def namespace(self, ns_id: bytes) -> Namespace:
        """The registered namespace; raises the unknown-namespace RequestError (404) otherwise."""
        return self.namespaces.get(ns_id)

    def owner_of(self, ns: Namespace) -> str:
        """Whom a namespace's resources are counted against (store/ledger.py)."""
        return self.ledger.owner_of(ns)

    def quota_of(self, ns: Namespace) -> int | None:
        return self.ledger.quota_of(ns)

    def shape_of(self, ns_id: bytes) -> ModelShape | None:
        return self.namespaces.shape_of(ns_id)

    @property
    def tenant_bytes(self) -> Mapping[str, int]:
        """Bytes each tenant holds (entries, committed plus pending, and namespace records)."""
        return self.ledger.bytes

    namespace_charge = staticmethod(namespace_charge)

    def held_by(self, owner: str) -> dict[str, int]:
        """What one owner (a tenant, or everyone on an open store) makes the store hold: namespaces,
        leases, remembered offers, and bytes charged to its quota."""
        return {"namespaces": self.ledger.namespaces_of(owner), "leases": self.leases.held_by(owner),
                "leased_bytes": self.leases.bytes_held_by(owner), "offers": self.writes.offers_of(owner),
                "bytes": self.ledger.bytes_of(owner), "entries": self.ledger.entries_of(owner)}

    # ------------------------------------------------------------ introspection seams (tests, CLI)

    @property
    def tier(self) -> LmdbTier | None:
        return self.disk.tier

    @property
    def pending(self) -> Mapping[bytes, Entry]:
        return self.writes.pending

    @property
    def read_hooks(self) -> list[Callable[[list[Entry]], None]]:
        return self.reads.read_hooks

    @property
    def foreign_parents(self) -> bool:
        return self.writes.foreign_parents

    def entry(self, ns_id: bytes, key: bytes) -> Entry | None:
        """The committed entry of wire key ``key`` in namespace ``ns_id``."""
        return self.index.get(scope(ns_id, key))

    def pending_entry(self, ns_id: bytes, key: bytes) -> Entry | None:
        """The uncommitted (put, not committed) entry of ``key`` in ``ns_id``."""
        return self.writes.pending.get(scope(ns_id, key))

    # ------------------------------------------------------------ requests

    def lookup(self, req: LookupRequest, defer: Callable[[Callable[[], None]], object] | None = None) -> LookupAnswer:
        return self.lookups.lookup(req, defer)

    def probe(self, req: ProbeRequest, replicas_of: Mapping[bytes, tuple[str, ...]] | None = None,
              root_home: Callable[[bytes], bool] = lambda key: True,
              copies: Collection[bytes] = frozenset()) -> ProbeAnswer:
        """One hop of a cluster lookup's walk (store/lookups.py)."""
        return self.lookups.probe(req, replicas_of, root_home, copies)

    def report(self, report: LookupReport) -> bool:
        """Teach a cluster client's lookup report (False: past its tenant's allowance, not taught)."""
        return self.lookups.report(report)

    def release(self, lease_id: bytes) -> bool:
        return self.leases.release(lease_id)

    def offer(self, ns_id: bytes, items: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        return self.writes.offer(self.namespaces.get(ns_id), items, place)

    def plan_put(self, ns_id: bytes, items: Sequence[ItemSpec]) -> PutPlan:
        return self.writes.plan_put(self.namespaces.get(ns_id), items)

    async def room_for(self, items: Sequence[ItemSpec]) -> None:
        """Before a put is planned: where its payloads do not fit in the free pages and committed
        entries are still behind the write-behind (store/behind.py), wait -- at most a few
        write_behind_s -- until they are written, so eviction can demote them to make room, as
        ``sync`` would at once. Without it a burst larger than the free RAM is refused while the
        writer catches up (benchmarks/nixl_lmdb_read.py's set-up caught it)."""
        need = sum(self.arena.pages_for(it.size) for it in items if it.size > 0)
        if need <= self.arena.num_free or not self.behind.entries:
            return
        try:
            await asyncio.wait_for(self.behind.drain(), 2 * self.config.write_behind_s + 1.0)
        except TimeoutError:
            pass  # planned as it is: what does not fit is refused, as before

    def intake(self, order: PutOrder) -> PutIntake:
        """A put's plans, reserved a chunk at a time as its body streams in (store/puts.py)."""
        return PutIntake(self.writes, self.ledger, self.namespaces.get(order.namespace_id), order)

    def reserve(self, ns_id: bytes, items: Sequence[ItemSpec]) -> PutPlan:
        """:meth:`plan_put`, refused whole over the tenant's quota (WritePath.reserve)."""
        return self.writes.reserve(self.namespaces.get(ns_id), items)

    def abort_put(self, plan: PutPlan) -> None:
        self.writes.abort_put(plan)

    def verify_put(self, plan: PutPlan) -> None:
        self.writes.verify_put(plan)

    def verify_pending(self, ns_id: bytes, keys: Sequence[bytes]) -> tuple[list[ItemResult], int]:
        return self.writes.verify_pending(ns_id, keys)

    async def commit(self, ns_id: bytes, keys: Sequence[bytes]) -> list[ItemResult]:
        return await self.writes.commit(ns_id, keys)

    async def prepare_get(self, ns_id: bytes, items: Sequence[GetItem], map_disk: MapDisk | None = None,
                          field: str = "items") -> GetPlan:
        return await self.reads.prepare_get(self.namespaces.get(ns_id), items, map_disk, field)

    def payload_views(self, slot: GetSlot) -> list[memoryview]:
        return self.reads.payload_views(slot)

    def body_views(self, plan: GetPlan) -> list[memoryview]:
        return self.reads.body_views(plan)

    def finish_get(self, plan: GetPlan) -> None:
        self.reads.finish_get(plan)

    def delete(self, e: Entry, reason: str) -> None:
        """Remove an entry and everything that depends on it (replica drops, store/replication.py)."""
        self.space.delete(e, reason)

    def flush(self) -> int:
        """Delete every committed entry (the admin flush); returns how many."""
        return self.space.drop_all("flushed")

    def delete_namespaces(self, ns_ids: Collection[bytes]) -> int:
        """Delete every committed entry of these namespaces (the admin delete); returns how many.
        The namespaces stay registered (their records are a few hundred bytes; engines register
        lazily anyway)."""
        return self.space.drop_all("deleted", ns_ids)

    @property
    def arena_ready(self) -> bool:
        """Whether the RAM arena is mapped in (its prefault at start-up has finished): /readyz."""
        return self._prefault is not None and self._prefault.done()

    # ------------------------------------------------------------ reporting and checking

    def _gauges(self) -> dict[str, float]:
        """Read at scrape time (store/metrics.py), so they can never drift from what is held."""
        tier = self.disk.tier
        return {
            "prefixstore_arena_capacity_bytes": self.arena.capacity_bytes,
            "prefixstore_arena_free_bytes": self.arena.num_free * self.arena.page_bytes,
            "prefixstore_leases": len(self.leases),
            "prefixstore_pending_entries": len(self.writes.pending),
            "prefixstore_lmdb_read_txns": tier.pinned if tier is not None else 0,
            "prefixstore_write_behind_bytes": self.behind.bytes,
            "prefixstore_write_behind_entries": self.behind.entries,
            "prefixstore_write_behind_lag_seconds": self.behind.lag_s(),
            "prefixstore_lmdb_full": float(self.disk.full),
            "prefixstore_read_buffer_bytes": self.reads.buffered_bytes,
        }

    def stats(self) -> dict[str, object]:
        idx = self.index
        tier = self.disk.tier
        return {
            "namespaces": len(self.namespaces),
            "entries": {f"{k}/{t}": n for (k, t), n in sorted(idx.stored_entries.items())},
            "stored_bytes": {f"{k}/{t}": n for (k, t), n in sorted(idx.stored_bytes.items())},
            "arena": {"capacity_bytes": self.arena.capacity_bytes, "page_bytes": self.arena.page_bytes,
                      "free_bytes": self.arena.num_free * self.arena.page_bytes},
            "disk": {"enabled": tier is not None, "budget_bytes": self.config.disk_bytes,
                     "payload_bytes": idx.disk_bytes(), "path": str(tier.path) if tier is not None else None,
                     "durability": self.config.durability, "full": self.disk.full,
                     "behind": {"bytes": self.behind.bytes, "entries": self.behind.entries,
                                "lag_s": round(self.behind.lag_s(), 3)}},
            "leases": len(self.leases),
            "pending": len(self.writes.pending),
            "tenants": {name: {"stored_bytes": n, "quota_bytes": self.tenants.quota_of(name) if self.tenants else None}
                        for name, n in sorted(self.ledger.bytes.items())},
            "policies": {"kv_admission": self.admission[Kind.BLOCK].name,
                         "state_admission": self.admission[Kind.STATE].name,
                         "eviction": self.eviction.name},
        }

    def check(self) -> None:
        """Verify the store's invariants (index, arena accounting, queues, ledger); raise naming the broken one."""
        self.index.check(self.namespaces.root_nodes(), foreign_parents=self.foreign_parents)
        holders = list(self.index.entries.values()) + list(self.writes.pending.values())
        self.space.check(holders, self.behind.behind())
        held: dict[str, int] = {}
        counts: dict[str, int] = {}
        for e in holders:
            ns = self.namespaces.find(e.namespace_id)
            if ns is None:
                raise IndexInvariantError(f"entry {e.key.hex()}: its namespace is not registered")
            held[ns.tenant] = held.get(ns.tenant, 0) + e.charge
            counts[ns.tenant] = counts.get(ns.tenant, 0) + 1
        self.ledger.check(list(self.namespaces), held, counts)


__all__ = ["OPEN_TENANT", "GetPlan", "GetSlot", "PutPlan", "Store"]
