"""The tenant ledger: what each tenant makes the store hold, and its quota.

An *owner* is whom resources are counted against: a namespace's tenant, or one owner for all on
a store without a tenants file (``OPEN_TENANT``). Bytes are counted per tenant name (the quota's
unit): entries' payload bytes, committed plus pending (a quota counts what a put was promised),
plus each registered namespace's record. They are charged where entries are taken (offers are
not: they move no bytes) and refunded where they leave, so ``bytes_of(t)`` is always what ``t``
holds (``Store.check`` verifies it against the entries).

Entries are counted the same way, where bytes are: ``max_entries`` bounds the index's memory by
count, and as one pool it let one tenant's long prompt of tiny blocks (inside its byte quota)
push every other tenant's entries out (issue 30: 200/200 hits -> 0/200). With a tenants file
each tenant may hold ``entry_share`` = ``max_entries`` / the number of tenants, committed plus
pending; an item past it is refused as over quota, so the tenants' shares together never reach
the pool's bound and ``max_entries`` never evicts one tenant's entry for another's.
"""

from __future__ import annotations

from collections.abc import Mapping

from prefixstore.protocol.namespace import Namespace
from .index import IndexInvariantError
from .metrics import StoreMetrics
from .tenants import Tenants

OPEN_TENANT = "default"  # whom everything belongs to on a store without a tenants file
NAMESPACE_RECORD_OVERHEAD = 64  # bytes charged per namespace beside its encoding (index, LMDB key)


def namespace_charge(ns: Namespace) -> int:
    """Bytes a registered namespace is charged to its tenant's quota (its record, kept for good)."""
    return len(ns.encode()) + NAMESPACE_RECORD_OVERHEAD


class TenantLedger:
    def __init__(self, tenants: Tenants | None, metrics: StoreMetrics, max_entries: int = 1 << 62) -> None:
        self.tenants = tenants
        self._metrics = metrics
        self._bytes: dict[str, int] = {}
        self._entries: dict[str, int] = {}  # per tenant name, like bytes
        self._namespaces: dict[str, int] = {}  # per owner
        # None on an open store: its one tenant has the whole pool (max_entries evicts as ever).
        self.entry_share = max(1, max_entries // len(tenants.tenants)) if tenants is not None else None

    def owner_of(self, ns: Namespace) -> str:
        return ns.tenant if self.tenants is not None else OPEN_TENANT

    def quota_of(self, ns: Namespace) -> int | None:
        return self.tenants.quota_of(ns.tenant) if self.tenants is not None else None

    def bytes_of(self, tenant: str) -> int:
        return self._bytes.get(tenant, 0)

    def entries_of(self, tenant: str) -> int:
        return self._entries.get(tenant, 0)

    def namespaces_of(self, owner: str) -> int:
        return self._namespaces.get(owner, 0)

    @property
    def bytes(self) -> Mapping[str, int]:
        """Bytes held per tenant (read-only view)."""
        return self._bytes

    def charge(self, ns: Namespace, nbytes: int, nentries: int = 0) -> None:
        """Count ``nbytes`` and ``nentries`` (negative: refund) against the namespace's tenant."""
        self._bytes[ns.tenant] = self._bytes.get(ns.tenant, 0) + nbytes
        if nentries:
            self._entries[ns.tenant] = self._entries.get(ns.tenant, 0) + nentries

    def over_quota(self, ns: Namespace, nbytes: int, taken: int | None = None) -> bool:
        """Whether holding ``nbytes`` more would take the tenant over its quota (``taken``: what it
        holds counting a batch under way; default what it holds now). Counted when refused."""
        quota = self.quota_of(ns)
        if quota is None:
            return False
        over = (self.bytes_of(ns.tenant) if taken is None else taken) + nbytes > quota
        if over:
            self._metrics.quota_rejections.labels(ns.tenant).inc()
        return over

    def could_hold(self, ns: Namespace, nbytes: int, entries: int) -> bool:
        """Whether the tenant could hold ``nbytes`` and ``entries`` more than it does now, within its
        quota and entry share. A question (store/puts.py asks it before planning): nothing counted."""
        quota = self.quota_of(ns)
        if quota is not None and self.bytes_of(ns.tenant) + nbytes > quota:
            return False
        return self.entry_share is None or self.entries_of(ns.tenant) + entries <= self.entry_share

    def over_entries(self, ns: Namespace, taken: int) -> bool:
        """Whether one more entry would take the tenant past its ``entry_share`` (``taken``: the
        entries it holds counting a batch under way). Counted when refused, as a quota refusal."""
        over = self.entry_share is not None and taken + 1 > self.entry_share
        if over:
            self._metrics.quota_rejections.labels(ns.tenant).inc()
        return over

    def add_namespace(self, ns: Namespace) -> None:
        owner = self.owner_of(ns)
        self._namespaces[owner] = self._namespaces.get(owner, 0) + 1
        self.charge(ns, namespace_charge(ns))

    def remove_namespace(self, ns: Namespace) -> None:
        owner = self.owner_of(ns)
        self._namespaces[owner] -= 1
        self.charge(ns, -namespace_charge(ns))

    def check(self, namespaces: list[Namespace], entry_bytes: Mapping[str, int],
              entry_counts: Mapping[str, int] | None = None) -> None:
        """The counters equal what is held: ``entry_bytes`` per tenant of entries (committed and
        pending) plus every namespace's record, and ``entry_counts`` entries per tenant."""
        if entry_counts is not None and {t: n for t, n in self._entries.items() if n} != \
                {t: n for t, n in entry_counts.items() if n}:
            raise IndexInvariantError(f"tenant entries {self._entries} differ from those held {dict(entry_counts)}")
        owed = dict(entry_bytes)
        owned: dict[str, int] = {}
        for ns in namespaces:
            owed[ns.tenant] = owed.get(ns.tenant, 0) + namespace_charge(ns)
            owned[self.owner_of(ns)] = owned.get(self.owner_of(ns), 0) + 1
        if {t: n for t, n in self._namespaces.items() if n} != owned:
            raise IndexInvariantError(f"namespace counts {self._namespaces} differ from those held {owned}")
        if {t: n for t, n in self._bytes.items() if n} != {t: n for t, n in owed.items() if n}:
            raise IndexInvariantError(f"tenant bytes {self._bytes} differ from what is held {owed}")


__all__ = ["NAMESPACE_RECORD_OVERHEAD", "OPEN_TENANT", "TenantLedger", "namespace_charge"]
