"""A node's answer to a cluster lookup: per level of the prompt, what this node holds (``POST /v1/probe``).

protocol/probe.py has the message and the merge rule. Each level here is
exactly the single-node match (store/index.py ``Index.match``) restricted to
one parent hash h_j:

* ``held``: block h_{j+1} is indexed here under h_j;
* else ``child``: of the (most recent ``max_child_scan``) children of h_j with
  the prompt's extra keys, the one whose tokens agree longest with the level's
  tokens;
* ``snapshot``: of the snapshots registered under h_j, the largest boundary
  b with ``b - jB <= agreement of its container`` (B for the prompt's own
  block h_{j+1}) and ``b <= jB + B`` when h_{j+1} is held here, ``b <= jB +
  child's usable tokens`` when it is not. When this level turns out to be the
  last matched one (m), the latter is ``kv_tokens``, the bound a single node
  applies; below m the bound holds by construction. So the client's merge
  (first level not held; best snapshot of levels <= m) is the single-node
  answer.

Pure apart from the lease, like a lookup: policies learn of it only through
the client's ``/v1/lookup_report`` (see store/server.py).
"""

from __future__ import annotations

from ..protocol.keys import Kind
from ..protocol.probe import LevelAnswer, ProbeAnswer, ProbeRequest
from ..protocol.wire import EntryRef
from .core import Store
from .index import Entry, lcp_tokens


def probe(store: Store, req: ProbeRequest, replicas_of: dict[bytes, tuple[str, ...]] | None = None) -> ProbeAnswer:
    """Answer every level of ``req`` this node can; lease what it reports when asked."""
    ns = store.namespace(req.namespace_id)
    ns_id = ns.id  # every key probed below is scoped by the request's namespace (store/index.py)
    B = ns.block_tokens
    entries = store.index.entries
    children = store.index.children
    scan = store.config.max_child_scan
    now = store.clock()
    store.leases.expire(now)
    answers: list[LevelAnswer] = []
    held_entries: list[Entry] = []
    for lv in req.levels:
        j, parent, seg = lv.level, lv.parent, lv.tokens
        nxt = store.index.get_block(ns_id, lv.next) if lv.next else None
        held = nxt is not None and nxt.parent == parent
        child: Entry | None = None
        usable = 0
        if held:
            assert nxt is not None
            held_entries.append(nxt)
            limit = j * B + B
        else:
            kids = children.get(ns_id + parent)
            if kids and seg:
                for n, ck in enumerate(reversed(kids)):
                    if n >= scan:
                        break
                    c = entries[ck]
                    if c.extra != lv.extra:
                        continue
                    a = lcp_tokens(c.tokens, seg)
                    if a > usable:
                        child, usable = c, a
            limit = j * B + usable
        snapshot = store.index.best_snapshot_under(
            ns_id + parent, seg, j * B, B, own_next=lv.next if held else None, extra=lv.extra, limit=limit, scan=scan)
        if child is not None:
            held_entries.append(child)
        if snapshot is not None:
            held_entries.append(snapshot)
            container = entries.get(snapshot.container or b"")
            if container is not None:
                held_entries.append(container)
        answers.append(LevelAnswer(level=j, held=held,
                                   child=_ref(child, usable) if child is not None else None,
                                   snapshot=_ref(snapshot, snapshot.boundary) if snapshot is not None else None))
    lease_id = None
    if req.lease and held_entries:
        unique: dict[bytes, Entry] = {e.key: e for e in held_entries}
        lease_id = store.leases.grant(list(unique.values()), now, store.config.lease_ttl_s, owner=store.owner_of(ns))
    replicas: dict[bytes, tuple[str, ...]] = {}
    if replicas_of:
        for e in held_entries:
            where = replicas_of.get(e.key)
            if where:
                replicas[e.wire_key] = where
    return ProbeAnswer(levels=tuple(answers), lease_id=lease_id,
                       lease_ttl_s=store.config.lease_ttl_s if lease_id else 0.0, replicas=replicas)


def _ref(e: Entry, usable: int) -> EntryRef:
    return EntryRef(key=e.wire_key, num_tokens=e.num_tokens, usable_tokens=usable, size=e.size,
                    tier="ram" if e.pages is not None else "disk")


__all__ = ["probe"]
