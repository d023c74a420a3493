"""A put as a service: what its header asks (:class:`PutOrder`), its pages reserved a chunk at a
time while the body streams in (:class:`PutIntake`), and its answer. The HTTP route
(store/api.py ``put``) only frames: it reads the header, checks the caller owns the namespace,
fills each plan's pages from the body as the plan is made, and writes the answer.

Why chunks: deciding an item (validate, admit, charge, reserve: store/writes.py ``plan_put``) is
per-item Python, tens of microseconds each. Planned whole before the body was read, a put of
1,024 x 64 KiB kept its client blocked on a full socket buffer for those tens of milliseconds,
then kept the store copying while the client had nothing left to do. Planned a chunk at a time
(:data:`CHUNK_ITEMS` items or :data:`CHUNK_BYTES` payload bytes, whichever comes first), the
store decides chunk k+1 while chunk k's bytes are still arriving: the client never waits for
the whole batch's decisions.

What stays whole: a put on a cluster node (below), and a put over its tenant's quota, refused
whole, nothing stored. When the
whole put fits the quota as the tenant stands (every item charged, as if none were stored yet)
no chunk can go over it alone, so chunks are safe; when it may not fit, the put is planned in
one chunk and refused before any payload byte is read, as before. A concurrent put of the same
tenant that charges between two chunks can still push a later chunk over: then every chunk
reserved so far is given back and the put refused whole all the same (its bytes read, none kept).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from prefixstore.protocol.errors import ItemStatus, Problem
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import PREFIX_BYTES, ItemResult, ItemSpec, Limits, WireError, parse_items, req_bool
from .index import entry_charge
from .ledger import TenantLedger
from .writes import PutPlan, WritePath

CHUNK_ITEMS = 64
"""Most items planned at once (a chunk of a put)."""
CHUNK_BYTES = 4 << 20
"""Most payload bytes planned at once: about what a loopback socket buffers while the store decides
the next chunk."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PutOrder:
    """What a put's header asks, checked: the items, whether to commit them now, whether they are
    a hot entry's replicas pushed by its owner, and the payload bytes the body must carry."""

    namespace_id: bytes
    items: list[ItemSpec]
    commit: bool
    replica: bool
    payload_bytes: int


def read_order(header: dict[str, object], namespace_id: bytes, header_len: int, declared_bytes: int | None,
               limits: Limits, max_body_bytes: int, from_peer: bool) -> PutOrder:
    """The put a header asks for, or a WireError naming what is wrong: a peer (the cluster token)
    may only push committed replicas; the payloads the header lists must fit ``max_body_bytes``
    and agree with the request's Content-Length (``declared_bytes``)."""
    items = parse_items(header, limits)
    commit_now = req_bool(header, "commit", default=True)
    replica = req_bool(header, "replica", default=False)
    if from_peer and not (commit_now and replica):
        raise WireError("replica", "the cluster token may only push committed replicas", Problem.FORBIDDEN)
    payload_bytes = sum(it.size for it in items)
    if PREFIX_BYTES + header_len + payload_bytes > max_body_bytes:
        raise WireError("body", f"the header lists {payload_bytes} payload bytes, more than "
                        f"max_body_bytes={max_body_bytes} allows", Problem.TOO_LARGE)
    if declared_bytes is not None and declared_bytes != PREFIX_BYTES + header_len + payload_bytes:
        raise WireError("frame", f"Content-Length is {declared_bytes} bytes but the header lists "
                        f"{payload_bytes} payload bytes ({PREFIX_BYTES + header_len + payload_bytes} in all)")
    return PutOrder(namespace_id=namespace_id, items=items, commit=commit_now, replica=replica,
                    payload_bytes=payload_bytes)


def chunks(items: Sequence[ItemSpec], max_items: int = CHUNK_ITEMS, max_bytes: int = CHUNK_BYTES
           ) -> list[tuple[int, int]]:
    """[lo, hi) ranges of ``items``, in order: at most ``max_items`` items and, past the first item,
    ``max_bytes`` payload bytes each."""
    out: list[tuple[int, int]] = []
    lo, size = 0, 0
    for i, it in enumerate(items):
        if i > lo and (i - lo >= max_items or size + it.size > max_bytes):
            out.append((lo, i))
            lo, size = i, 0
        size += it.size
    if lo < len(items):
        out.append((lo, len(items)))
    return out


def fits_whole(ledger: TenantLedger, ns: Namespace, items: Sequence[ItemSpec]) -> bool:
    """Whether every item of the put, charged as new, fits the tenant's quota and entry share as
    it stands now: then no chunk of it can be refused over quota on its own."""
    return ledger.could_hold(ns, sum(entry_charge(it.size, it.tokens, it.extra) for it in items), len(items))


class PutIntake:
    """One put's plans, reserved a chunk at a time as the route asks for them (module docstring)."""

    def __init__(self, writes: WritePath, ledger: TenantLedger, ns: Namespace, order: PutOrder) -> None:
        self._writes = writes
        self._ns = ns
        self.order = order
        items = order.items
        # A cluster node plans a put whole: whether an item hangs below a fork head (an answer
        # ``elsewhere``) is decided against the items before it in the same put (WritePath._triage's
        # ``below``), which chunks would split.
        chunked = not writes.foreign_parents and fits_whole(ledger, ns, items)
        self._ranges = chunks(items) if chunked else [(0, len(items))]
        self.plans: list[PutPlan] = []

    def __iter__(self) -> Iterator[PutPlan]:
        """Each chunk's plan, reserved when asked for (WritePath.reserve: refused whole over quota)."""
        for lo, hi in self._ranges:
            plan = self._writes.reserve(self._ns, self.order.items[lo:hi])
            self.plans.append(plan)
            yield plan

    def abort(self) -> None:
        """The body did not arrive whole, or a chunk was refused: give back every chunk reserved."""
        for plan in self.plans:
            self._writes.abort_put(plan)
        self.plans.clear()

    def verify(self) -> None:
        """Every payload against its checksum (WritePath.verify_put), once the body is in."""
        for plan in self.plans:
            self._writes.verify_put(plan)

    @property
    def results(self) -> list[ItemResult]:
        return [r for plan in self.plans for r in plan.results]

    @property
    def keys(self) -> list[bytes]:
        """Wire keys of the entries reserved, for the commit."""
        return [k for plan in self.plans for k in plan.keys]

    async def finish(self, replica_keys: set[bytes] | None) -> list[ItemResult]:
        """Verify, commit when the order says so, and answer per item. ``replica_keys``: where to
        note the entries taken as another node's replicas (None: these are not replicas)."""
        self.verify()
        results = self.results
        if not self.order.commit:
            return results
        entries = [e for plan in self.plans for e in plan.entries]
        committed = iter(await self._writes.commit(self._ns.id, self.keys))
        results = [next(committed) if e is not None else r for e, r in zip(entries, results)]
        if replica_keys is not None:
            replica_keys.update(e.key for e, r in zip(entries, results)
                                if e is not None and r.status is ItemStatus.OK)
        return results


__all__ = ["CHUNK_BYTES", "CHUNK_ITEMS", "PutIntake", "PutOrder", "chunks", "fits_whole", "read_order"]
