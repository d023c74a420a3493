"""The index's invariant checker (``Index.check``) and its bookkeeping, on a hand-built index.

Every store test ends with ``Store.check()``, but on a healthy store the checker never has
anything to find, so a checker that looked at nothing would pass them all. Here each
invariant of store/index.py's docstring is broken on purpose, through the index's public
fields, and ``check`` must name it. Written against the survivors of a mutation sample of
store/index.py (docs/testing.md), with the deletion order (``subtree``) and the disk
budget's record bytes (``disk_charge``).

The index: namespace N, B = 4 tokens. Blocks b0 = [1..4] (under the root) and b1 = [5..8]
(under b0), a tail t = [9, 10] under b1, a snapshot s at boundary 6 (inside b1), and a fork
record r = [5, 6, 7, 9] under b0 (a second child of b0: no payload).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from prefixstore.protocol import Kind
from prefixstore.protocol.hashing import TOKEN_BYTES
from prefixstore.store.index import (
    SCAN_BUDGET_PER_SCAN,
    Entry,
    Index,
    IndexInvariantError,
    ScanBudget,
    entry_charge,
    node_key,
    store_key,
)

N = b"N" * 8  # a namespace id
ROOT = b"\x00" * 16  # its root hash h_0
ROOTS = {node_key(N, ROOT)}


def packed(*tokens: int) -> bytes:
    return b"".join(t.to_bytes(TOKEN_BYTES, "little") for t in tokens)


def kv(name: bytes, kind: Kind, parent: bytes, start: int, tokens: bytes, *, size: int = 64,
       record: bool = False, on_disk: bool = False) -> Entry:
    h = name * 16
    return Entry(key=store_key(N, kind, h), kind=kind, hash=h, namespace_id=N, parent=parent, start=start,
                 tokens=tokens, extra=b"", container=None, boundary=0, size=0 if record else size, checksum=0,
                 pages=None if record or on_disk else [0], on_disk=on_disk, record=record)


def built() -> tuple[Index, dict[str, Entry]]:
    ix = Index()
    b0 = kv(b"a", Kind.BLOCK, ROOT, 0, packed(1, 2, 3, 4))
    b1 = kv(b"b", Kind.BLOCK, b0.hash, 4, packed(5, 6, 7, 8))
    t = kv(b"c", Kind.TAIL, b1.hash, 8, packed(9, 10), size=48)
    r = kv(b"r", Kind.BLOCK, b0.hash, 4, packed(5, 6, 7, 9), record=True)
    s = Entry(key=store_key(N, Kind.STATE, b"s" * 16), kind=Kind.STATE, hash=b"s" * 16, namespace_id=N,
              parent=None, start=0, tokens=b"", extra=b"", container=b1.key, boundary=6, size=16, checksum=0,
              pages=[1])
    for e in (b0, b1, t, r, s):
        ix.insert(e)
    ix.check(ROOTS)
    return ix, {"b0": b0, "b1": b1, "t": t, "r": r, "s": s}


def test_a_healthy_index_passes_and_counts_what_it_holds() -> None:
    ix, e = built()
    assert ix.fork_records == 1
    assert (e["b0"].num_children, e["b1"].num_children, e["b1"].num_snapshots) == (2, 1, 1)
    assert dict(ix.stored_bytes) == {("kv", "ram"): 64 + 64 + 48, ("state", "ram"): 16}
    assert dict(ix.stored_entries) == {("kv", "ram"): 3, ("state", "ram"): 1}
    assert ix.continuation == {node_key(N, ROOT): e["b0"].key, node_key(N, e["b0"].hash): e["b1"].key}


def _bump(counter: str, label: tuple[str, str], by: int) -> Callable[[Index, dict[str, Entry]], None]:
    def go(ix: Index, e: dict[str, Entry]) -> None:
        getattr(ix, counter)[label] += by
    return go


def _set(name: str, field: str, value: object) -> Callable[[Index, dict[str, Entry]], None]:
    def go(ix: Index, e: dict[str, Entry]) -> None:
        setattr(e[name], field, value)
    return go


CORRUPTIONS: dict[str, tuple[Callable[[Index, dict[str, Entry]], None], str]] = {
    # a fork record holds no payload: neither bytes nor pages
    "record with a payload size": (_set("r", "size", 64), "a fork record is a block with no payload"),
    "record with pages": (_set("r", "pages", [2]), "a fork record is a block with no payload"),
    "record that is a tail": (_set("r", "kind", Kind.TAIL), "key"),  # its key says block: caught first
    "entry in no tier": (_set("t", "pages", None), "in no tier"),
    "uncommitted entry": (_set("t", "committed", False), "committed/dead"),
    # prefix closure: a block starts where its parent ends, not before and not after
    "block starting before its parent ends": (_set("b1", "start", 3), "starts at 3, parent ends at 4"),
    "block starting after its parent ends": (_set("b1", "start", 5), "starts at 5, parent ends at 4"),
    "child of the root not at 0": (_set("b0", "start", 1), "child of a root must start at 0"),
    "snapshot boundary past its container": (_set("s", "boundary", 9), "boundary outside"),
    "snapshot boundary at its container's start": (_set("s", "boundary", 4), "boundary outside"),
    # the per-entry counts, stale up and down
    "one child too many": (_set("b0", "num_children", 3), "child/snapshot counts are stale"),
    "one child too few": (_set("b0", "num_children", 1), "child/snapshot counts are stale"),
    "one snapshot too many": (_set("b1", "num_snapshots", 2), "child/snapshot counts are stale"),
    "one snapshot too few": (_set("b1", "num_snapshots", 0), "child/snapshot counts are stale"),
    # the byte and entry counters, off up and down, and a tier the counters have but no entry is in
    "kv bytes in RAM one over": (_bump("stored_bytes", ("kv", "ram"), +1), "counter ('kv', 'ram') is off"),
    "kv bytes in RAM one under": (_bump("stored_bytes", ("kv", "ram"), -1), "counter ('kv', 'ram') is off"),
    "state entries in RAM one over": (_bump("stored_entries", ("state", "ram"), +1), "counter ('state', 'ram') is off"),
    "state entries in RAM one under": (_bump("stored_entries", ("state", "ram"), -1), "counter ('state', 'ram') is off"),
    "bytes on disk with nothing there": (_bump("stored_bytes", ("kv", "disk"), +64), "counter ('kv', 'disk') is off"),
    "fork records one over": (lambda ix, e: setattr(ix, "fork_records", 2), "fork record counter is off"),
    "fork records one under": (lambda ix, e: setattr(ix, "fork_records", 0), "fork record counter is off"),
    "continuation naming the record": (lambda ix, e: ix.continuation.__setitem__(node_key(N, e["b0"].hash), e["r"].key),
                                       "does not name a block child"),
}


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_check_names_each_broken_invariant(name: str) -> None:
    ix, e = built()
    corrupt, message = CORRUPTIONS[name]
    corrupt(ix, e)
    with pytest.raises(IndexInvariantError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ix.check(ROOTS)


def test_a_missing_parent_is_broken_prefix_closure_except_on_a_cluster_node() -> None:
    ix = Index()
    ix.insert(kv(b"b", Kind.BLOCK, b"a" * 16, 4, packed(5, 6, 7, 8)))  # its parent is held by no one here
    with pytest.raises(IndexInvariantError, match="parent missing"):
        ix.check(ROOTS)
    ix.check(ROOTS, foreign_parents=True)  # a cluster node: the parent may be another node's


def test_subtree_lists_what_depends_on_an_entry_leaves_first() -> None:
    """b0's subtree is everything (b1 with its tail and snapshot, and the record), each entry
    after all that hangs from it: removing in that order never removes a non-leaf."""
    ix, e = built()
    order = ix.subtree(e["b0"])
    assert {x.key for x in order} == {x.key for x in e.values()} and order[-1] is e["b0"]
    assert order.index(e["b1"]) > max(order.index(e["t"]), order.index(e["s"]))
    assert [x.key for x in ix.subtree(e["b1"])][-1] == e["b1"].key and len(ix.subtree(e["b1"])) == 3
    for x in order:
        ix.remove(x)  # raises if x still had children or snapshots
    assert not ix.entries and ix.fork_records == 0
    ix.check(ROOTS)


def test_disk_charge_counts_payloads_and_records_of_what_is_on_disk() -> None:
    """What the disk budget counts: the payload bytes on disk, of both kinds, and each disk
    entry's record (tokens, extra keys, overhead); a RAM-only entry counts nothing, and a fork
    record on disk its record alone."""
    ix, e = built()
    assert ix.disk_bytes() == 0 and ix.disk_charge() == 0
    t, s, r = e["t"], e["s"], e["r"]
    ix.set_tier(t, [0], True)  # written through: in RAM and on disk
    assert ix.disk_bytes() == 48 and ix.disk_charge() == entry_charge(48, t.tokens, t.extra)
    ix.set_tier(t, None, True)  # demoted: on disk only
    ix.set_tier(s, None, True)
    assert ix.disk_bytes() == 48 + 16
    assert ix.disk_charge() == entry_charge(48, t.tokens, t.extra) + entry_charge(16, b"", b"")
    ix.set_tier(r, None, True)  # the record persisted
    records = entry_charge(48, t.tokens, t.extra) + entry_charge(16, b"", b"") + entry_charge(0, r.tokens, b"")
    assert ix.disk_charge() == records
    ix.check(ROOTS)
    ix.set_tier(t, [3], False)  # promoted back, the disk copies dropped
    ix.set_tier(s, [4], False)
    assert ix.disk_bytes() == 0 and ix.disk_charge() == entry_charge(0, r.tokens, b"")
    ix.check(ROOTS)


def test_a_scan_budget_is_eight_times_the_per_level_scan_in_all() -> None:
    """SCAN_BUDGET_PER_SCAN (8) x max_child_scan comparisons for one lookup, handed out until
    spent, then none: the answer may be lower, the search never unbounded."""
    assert SCAN_BUDGET_PER_SCAN == 8
    budget = ScanBudget(max_child_scan=5)
    assert budget.left == 40
    assert [budget.take(15), budget.take(15), budget.take(15), budget.take(1)] == [15, 15, 10, 0]
    assert budget.left == 0


def test_an_entry_is_charged_its_payload_tokens_extra_keys_and_overhead() -> None:
    """What a tenant's quota and the disk budget are charged per entry (ENTRY_OVERHEAD_BYTES = 512)."""
    assert entry_charge(64, packed(1, 2, 3, 4), b"") == 64 + 16 + 512
    assert entry_charge(0, packed(1, 2, 3, 4), b"x" * 8) == 16 + 8 + 512  # a fork record with extra keys
    assert entry_charge(16, b"", b"") == 16 + 512  # a snapshot
    assert entry_charge(48, packed(1, 2, 3, 4), b"") == 48 + 16 + 512  # sizes that share bits: a sum, not a mix


def test_an_entry_position_is_where_its_tokens_end_or_its_boundary() -> None:
    """Tokens consumed at the entry's end: what eviction prices (admission/eviction.py)."""
    _, e = built()
    assert [e[n].position for n in ("b0", "b1", "t", "s")] == [4, 8, 10, 6]
    assert [e[n].end for n in ("b0", "b1", "t")] == [4, 8, 10]


def test_only_the_scan_most_recent_snapshots_and_children_of_a_level_are_compared() -> None:
    """max_child_scan = 300 and 301 entries under one level: the oldest, the best match, is past
    the scan and never compared, so the answer is the best of the 300 newer ones (lower, never
    wrong). More than 256 so that the scan's end is a large int."""
    ix, e = built()
    b1 = e["b1"]
    level = node_key(N, e["b0"].hash)

    def snapshot(i: int, boundary: int) -> Entry:
        h = i.to_bytes(16, "little")
        return Entry(key=store_key(N, Kind.STATE, h), kind=Kind.STATE, hash=h, namespace_id=N, parent=None,
                     start=0, tokens=b"", extra=b"", container=b1.key, boundary=boundary, size=16, checksum=0,
                     pages=[1])

    for i in range(300):  # newer than s (boundary 6), each at boundary 5
        ix.insert(snapshot(1000 + i, 5))
    assert len(ix.snaps_under[level]) == 301
    best = ix.best_snapshot_under(level, packed(5, 6, 7, 8), 4, 4, own_next=None, extra=b"", limit=8, scan=300,
                                  budget=ScanBudget(300))
    assert best is not None and best.boundary == 5
    best = ix.best_snapshot_under(level, packed(5, 6, 7, 8), 4, 4, own_next=None, extra=b"", limit=8, scan=301,
                                  budget=ScanBudget(301))
    assert best is e["s"]  # in the scan: the largest boundary

    # Children: b1 and the record r under b0, then 300 newer tails [5] under b0.
    for i in range(300):
        h = (5000 + i).to_bytes(16, "little")
        ix.insert(Entry(key=store_key(N, Kind.TAIL, h), kind=Kind.TAIL, hash=h, namespace_id=N,
                        parent=e["b0"].hash, start=4, tokens=packed(5), extra=b"", container=None, boundary=0,
                        size=8, checksum=0, pages=[2]))
    child, agree = ix.best_child(level, packed(5, 6, 7, 8), b"", 300, ScanBudget(300))
    assert child is not None and child.kind is Kind.TAIL and agree == 1  # b1 ([5..8]) is past the scan
    child, agree = ix.best_child(level, packed(5, 6, 7, 8), b"", 302, ScanBudget(302))
    assert child is b1 and agree == 4
    ix.check(ROOTS)


def test_a_snapshot_counts_only_if_its_container_agrees_up_to_its_boundary_under_the_same_extra() -> None:
    """At level b0 (tokens from 4), s (boundary 6) needs its container b1 to agree with the
    prompt for 2 tokens: [5, 6, ...] does, [5, 9, ...] does not. A container stored under other
    extra keys (a LoRA) never agrees, whatever its tokens."""
    ix, e = built()
    level = node_key(N, e["b0"].hash)

    def best(seg: bytes, extra: bytes = b"", where: bytes = level, start: int = 4) -> Entry | None:
        return ix.best_snapshot_under(where, seg, start, 4, own_next=None, extra=extra, limit=8, scan=16,
                                      budget=ScanBudget(16))

    assert best(packed(5, 6, 9, 9)) is e["s"]
    assert best(packed(5, 9, 9, 9)) is None
    # Under the root: a tail [1, 2] stored with a LoRA's extra key and a snapshot at 2 in it.
    h = b"u" * 16
    ix.insert(Entry(key=store_key(N, Kind.TAIL, h), kind=Kind.TAIL, hash=h, namespace_id=N, parent=ROOT, start=0,
                    tokens=packed(1, 2), extra=b"lora", container=None, boundary=0, size=8, checksum=0, pages=[5]))
    su = Entry(key=store_key(N, Kind.STATE, b"v" * 16), kind=Kind.STATE, hash=b"v" * 16, namespace_id=N,
               parent=None, start=0, tokens=b"", extra=b"", container=store_key(N, Kind.TAIL, h), boundary=2,
               size=16, checksum=0, pages=[6])
    ix.insert(su)
    ix.check(ROOTS)
    root = node_key(N, ROOT)
    assert best(packed(1, 2, 3, 4), b"lora", root, 0) is su
    assert best(packed(1, 2, 3, 4), b"", root, 0) is None  # the same tokens without the LoRA
    assert best(packed(1, 2, 3, 4), b"a", root, 0) is None  # another extra, ordered below "lora"
