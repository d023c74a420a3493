"""Lookups that also say where the matched payloads lie (the NIXL path's one round trip).

A client on the NIXL path asks ``/v1/lookup`` with ``nixl: true``. Besides the match, the
answer then carries, for every matched payload that is in the RAM arena (each matched block,
the child, the snapshot), its size, its xxh3 and the (address, length) runs of the arena pages
that hold it::

    "nixl": {"agent": name, "meta_gen": g, "lease_ttl_s": t,
             "entries": [[entry_key, size, xxh3, runs], ...]}

and every entry listed is pinned by the lookup's lease (Leases.extend), so the client can READ
them straight away -- no /v1/nixl/get -- and releases the lease when it is done, as after any
lookup. Entries only on disk are left out: the client asks /v1/nixl/get for those, which
serves them from LMDB's map or promotes them. A cluster probe (``/v1/probe`` with ``nixl``)
places the payloads it reports the same way, under its own lease.

Invariants, and where they are kept:
- Runs are only handed out under the lease that pins their entries: the lease exists (the
  lookup granted it in the same event-loop step) and is extended before the answer is sent.
- A pinned entry is never evicted, demoted or overwritten, so the runs keep their bytes until
  the lease is released or expires (store/core.py); how a client proves its READ happened
  before that is in client/nixl_path.py (LookupRuns).
"""

from __future__ import annotations

from collections.abc import Callable

from prefixstore.protocol.hashing import HASH_BYTES
from prefixstore.protocol.nixl_wire import NixlPlacement, NixlPlacements
from prefixstore.protocol.probe import ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import LookupAnswer, LookupRequest, split_hashes
from .core import Store
from .index import Entry, scope

Encoder = Callable[[list[int], int, int], bytes]
"""NixlTarget.descriptors: (pages, offset, length) -> (address, length) runs."""


def describe(store: Store, descriptors: Encoder, req: LookupRequest, answer: LookupAnswer,
             agent: str, meta_gen: int) -> NixlPlacements | None:
    """The ``nixl`` part of a lookup answer (None when there is no lease to pin anything by)."""
    if answer.lease_id is None:
        return None
    ns_id = req.namespace_id  # every key below is scoped by the request's own namespace (store/index.py)
    entries = [store.index.get_block(ns_id, h) for h in split_hashes(req.hashes[: answer.matched_blocks * HASH_BYTES])]
    entries += [store.index.get(scope(ns_id, ref.key)) for ref in (answer.child, answer.snapshot) if ref is not None]
    return _place(store, descriptors, answer.lease_id, entries, agent, meta_gen)


def describe_probe(store: Store, descriptors: Encoder, req: ProbeRequest, answer: ProbeAnswer,
                   agent: str, meta_gen: int) -> NixlPlacements | None:
    """The same for a cluster probe (store/probe.py): the blocks it reports held, children and
    snapshots, under the probe's lease."""
    if answer.lease_id is None:
        return None
    ns_id = req.namespace_id
    entries: list[Entry | None] = [store.index.get_block(ns_id, h)
                                   for h in split_hashes(req.hashes[: answer.held * HASH_BYTES])]
    refs = [*answer.snapshots.values(), *([answer.stop.child] if answer.stop and answer.stop.child else [])]
    entries += [store.index.get(scope(ns_id, ref.key)) for ref in refs]
    return _place(store, descriptors, answer.lease_id, entries, agent, meta_gen)


def _place(store: Store, descriptors: Encoder, lease_id: bytes, candidates: list[Entry | None], agent: str,
           meta_gen: int) -> NixlPlacements | None:
    if not store.leases.holds(lease_id):
        return None
    entries: list[Entry] = []
    seen: set[bytes] = set()
    for e in candidates:
        if e is not None and e.pages is not None and not e.dead and e.key not in seen:
            entries.append(e)
            seen.add(e.key)
    # Only what the lease could pin is placed (its owner's bound, store/leases.py): the rest is read over HTTP.
    pinned = store.leases.extend(lease_id, entries)
    listed = tuple(NixlPlacement(e.wire_key, e.size, e.checksum, descriptors(e.pages, 0, e.size)) for e in pinned
                   if e.pages is not None)
    return NixlPlacements(agent=agent, meta_gen=meta_gen, lease_ttl_s=store.config.lease_ttl_s, entries=listed)


__all__ = ["describe", "describe_probe"]
