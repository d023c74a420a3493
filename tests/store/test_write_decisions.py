"""Offer and put decisions item by item, and their counters, for batches that mix outcomes.

Written against survivors of a mutation sample of store/writes.py (docs/testing.md): a
rejected item must not end the batch, a put carrying an item the store already has or
cannot take still reserves the rest and counts each decision, and a wanted offer is
forgotten pending_ttl_s after it was made. Same namespace as test_metric_values.py.
"""

from __future__ import annotations

from dataclasses import replace

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol.errors import Reason
from prefixstore.protocol.wire import STATUS_OK
from prefixstore.store import StoreConfig

from ..factories import kv_payload, make_namespace, state_payload
from .harness import fill_target
from .test_metric_values import A, counters, harness, ns, ram_only

__all__ = ["harness", "ns"]  # fixtures

C = list(range(50, 62))  # 12 tokens, nothing of it stored
DECISIONS = ("want", "have", "rejected")


def test_a_rejected_item_does_not_end_the_offer(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    orphan = Prompt(ns, C).kv_items(12)[1][0]  # block 1 of C: its parent (block 0) is not stored
    first = Prompt(ns, A).kv_items(8)[0][0]
    got = h.store.offer(ns.id, [orphan, first])
    assert [(d.status, d.reason) for d in got] == [("rejected", Reason.PARENT_MISSING), ("want", Reason.NONE)]
    assert counters(h.store, "prefixstore_admission_total", "decision", DECISIONS) == {
        ("kv", "want"): 1, ("kv", "have"): 0, ("kv", "rejected"): 1,
        ("state", "want"): 0, ("state", "have"): 0, ("state", "rejected"): 0}


def test_a_put_with_held_and_refused_items_takes_the_rest_and_counts_each(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    h.save(A[:4], 4)  # block 0 of A: offer want, put want
    before = counters(h.store, "prefixstore_admission_total", "decision", DECISIONS)
    (b0, a0, e0), (b1, a1, e1) = Prompt(ns, A).kv_items(8)
    orphans = [with_payload(s, kv_payload(ns, C, ca, cb)) for s, ca, cb in Prompt(ns, C).kv_items(12)[1:]]
    items = [with_payload(b0, kv_payload(ns, A, a0, e0)),  # held already
             *orphans,  # blocks 1 and 2 of C: parent not stored (two, so have and rejected differ)
             with_payload(b1, kv_payload(ns, A, a1, e1))]  # new, its parent held
    plan = h.store.plan_put(ns.id, items)
    assert [r.status for r in plan.results] == ["have", "rejected", "rejected", "pending"]
    assert [t is not None for t in plan.targets] == [False, False, False, True]
    after = counters(h.store, "prefixstore_admission_total", "decision", DECISIONS)
    assert {k: after[k] - before[k] for k in after} == {
        ("kv", "want"): 1, ("kv", "have"): 1, ("kv", "rejected"): 2,
        ("state", "want"): 0, ("state", "have"): 0, ("state", "rejected"): 0}
    target = plan.targets[3]
    assert target is not None
    fill_target(target, kv_payload(ns, A, a1, e1))
    h.store.verify_put(plan)
    assert [r.status for r in h.run(h.store.commit(ns.id, plan.keys))] == [STATUS_OK]
    assert h.lookup(A[:8])[1].kv_tokens == 8


def test_a_wanted_offer_is_forgotten_after_pending_ttl(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(pending_ttl_s=5.0), ns)
    owner = h.store.owner_of(ns)
    assert [d.status for d in h.store.offer(ns.id, [Prompt(ns, A).kv_items(4)[0][0]])] == ["want"]
    assert h.store.held_by(owner)["offers"] == 1
    h.now[0] += 4.0
    h.store.sweep()
    assert h.store.held_by(owner)["offers"] == 1  # 4 s of 5
    h.now[0] += 2.0
    h.store.sweep()
    assert h.store.held_by(owner)["offers"] == 0


def test_a_put_never_evicts_the_parent_it_builds_on(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """The arena holds one block (256 bytes), block 0 of A. A put of block 1 (its child) needs
    room, and the only candidate is that parent: it is pinned, so the put is refused and the
    parent stays; evicting it would leave the new block hanging from nothing."""
    h = harness(ram_only(ram_bytes=256), ns)
    h.save(A[:4], 4)
    (_, _, _), (b1, a1, e1) = Prompt(ns, A).kv_items(8)
    before = counters(h.store, "prefixstore_admission_total", "decision", DECISIONS)[("kv", "rejected")]
    plan = h.store.plan_put(ns.id, [with_payload(b1, kv_payload(ns, A, a1, e1))])
    assert [(r.status, r.reason) for r in plan.results] == [
        ("rejected", Reason.RAM_PINNED)]
    assert counters(h.store, "prefixstore_admission_total", "decision", DECISIONS)[("kv", "rejected")] == before + 1
    assert plan.keys == []
    assert h.lookup(A[:8], lease=False)[1].kv_tokens == 4


def test_an_item_larger_than_the_arena_is_refused_one_that_fills_it_is_taken(harness) -> None:  # type: ignore[no-untyped-def]
    big = make_namespace(block_tokens=8)  # a block is 512 bytes
    h = harness(ram_only(ram_bytes=512), big)
    got = h.store.offer(big.id, [Prompt(big, A[:8]).kv_items(8)[0][0]])
    assert [(d.status, d.reason) for d in got] == [("want", Reason.NONE)]
    small = harness(ram_only(ram_bytes=256), big)
    got = small.store.offer(big.id, [Prompt(big, A[:8]).kv_items(8)[0][0]])
    assert [(d.status, d.reason) for d in got] == [("rejected", Reason.TOO_LARGE)]


def test_a_reserved_put_survives_a_sweep_until_pending_ttl(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(pending_ttl_s=5.0), ns)
    keys, _ = h.stage(A[:4], 4)
    h.now[0] += 4.99
    h.store.sweep()  # 4.99 s of 5: still pending
    assert [r.status for r in h.run(h.store.commit(ns.id, keys))] == [STATUS_OK]
    keys, _ = h.stage(A[:8], 8)
    h.now[0] += 5.01
    h.store.sweep()
    assert [r.status for r in h.run(h.store.commit(ns.id, keys))] != [STATUS_OK]


def test_stats_and_gauges_report_free_bytes_and_the_disk_tier(ns, harness, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """1 KiB of 64-byte pages (16); one block (256 bytes, 4 pages) held: 768 bytes free."""
    h = harness(ram_only(ram_bytes=1024), ns)
    h.save(A[:4], 4)
    stats = h.store.stats()
    assert stats["arena"] == {"capacity_bytes": 1024, "page_bytes": 64, "free_bytes": 768}  # type: ignore[index]
    assert stats["disk"]["enabled"] is False  # type: ignore[index]
    registry = h.store.metrics.registry
    assert registry.get_sample_value("prefixstore_arena_free_bytes") == 768
    assert registry.get_sample_value("prefixstore_lmdb_read_txns") == 0
    on_disk = harness(StoreConfig(port=0, data_dir=str(tmp_path), ram_bytes=1024, page_bytes=64), ns)
    assert on_disk.store.stats()["disk"]["enabled"] is True  # type: ignore[index]
    assert on_disk.store.metrics.registry.get_sample_value("prefixstore_lmdb_read_txns") == 0


# A store configured as one node of a two-node cluster. Nothing here contacts the peers: the
# core only learns that a block's parent may be another node's (WritePath.foreign_parents), which
# is what turns on fork heads at offers. tests/cluster/ drives the same path between processes.
PEERS = "http://127.0.0.1:1,http://127.0.0.1:2"


def test_a_fork_head_sends_what_hangs_below_it_to_its_branch(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A's blocks 0 and 1 are stored: block 1 is the continuation of level h_1. D shares block 0
    and diverges in block 1, so D's block 1 is a fork head here (this node keeps its record);
    D's blocks 2 and 3 and the snapshot inside block 3 belong to the fork head's branch node
    (elsewhere, naming D's block 1), the second of them because its parent is a block of the
    same offer that is below the fork head. The snapshot inside the fork head itself stays
    here (it is registered at the head's level, whose home this is)."""
    h = harness(ram_only(peers=PEERS), ns)
    h.save(A[:8], 8)
    d_tokens = A[:4] + list(range(70, 82))  # 16 tokens: block 0 of A, then three blocks of its own
    d = Prompt(ns, d_tokens)
    h1 = d.hashes[0]
    blocks = [s for s, _, _ in d.kv_items(16)]
    snaps = [d.state_item(6, 16), d.state_item(14, 16)]  # inside block 1 (the fork head), inside block 3
    # Each item names the branch that placed it as a client does before it knows of the fork:
    # block 0 its own (a branch's first block), the rest the branch of level h_1.
    items = [replace(blocks[0], branch=h1), *(replace(b, branch=h1) for b in blocks[1:]),
             *(replace(s, branch=h1) for s in snaps)]
    before = counters(h.store, "prefixstore_admission_total", "decision", ("want", "elsewhere"))
    got = h.store.offer(ns.id, items)
    fork_head = d.hashes[1]
    assert [(r.status, r.fork, r.branch) for r in got] == [
        ("have", False, None),  # A's block 0
        ("want", True, None),  # the fork head: put its record here
        ("elsewhere", False, fork_head),  # its child
        ("elsewhere", False, fork_head),  # the child's child (in this offer, below the fork head)
        ("want", False, None),  # the snapshot at 6, inside the fork head
        ("elsewhere", False, fork_head),  # the snapshot at 14, inside block 3
    ]
    after = counters(h.store, "prefixstore_admission_total", "decision", ("want", "elsewhere"))
    assert {k: after[k] - before[k] for k in after} == {
        ("kv", "want"): 1, ("kv", "elsewhere"): 2, ("state", "want"): 1, ("state", "elsewhere"): 1}
    # The client puts what it was told: the fork head's record (no payload) and the snapshot.
    record = replace(items[1], record=True, size=0)
    snap = with_payload(items[4], state_payload(ns, d_tokens, 6))
    plan = h.store.plan_put(ns.id, [record, snap])
    assert [r.status for r in plan.results] == ["pending", "pending"] and plan.targets[0] is None
    target = plan.targets[1]
    assert target is not None
    fill_target(target, state_payload(ns, d_tokens, 6))
    h.store.verify_put(plan)
    assert [r.status for r in h.run(h.store.commit(ns.id, plan.keys))] == [STATUS_OK, STATUS_OK]
    # Offered again, the stored record answers have and still a fork head; its child goes to the branch.
    again = h.store.offer(ns.id, items[1:3])
    assert [(r.status, r.fork, r.branch) for r in again] == [("have", True, None), ("elsewhere", False, fork_head)]
    # A put of the fork head's payload here is refused (the record keeps the level exact); the
    # put's next item is still taken.
    d1 = with_payload(blocks[1], kv_payload(ns, d_tokens, 4, 8))
    tail = with_payload(Prompt(ns, C).kv_items(1)[0][0], kv_payload(ns, C, 0, 1))
    plan = h.store.plan_put(ns.id, [d1, tail])
    assert [r.status for r in plan.results] == ["rejected", "pending"]
    h.store.abort_put(plan)


def test_an_offer_naming_a_fork_head_twice_answers_fork_both_times(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """The second copy finds the first in the offer's own batch: the store already decided to keep
    a record of it, so it is answered have, still a fork head, and the block under it goes to
    the branch; never a plain have (the client would then put the block's payload here)."""
    h = harness(ram_only(peers=PEERS), ns)
    h.save(A[:8], 8)
    d = Prompt(ns, A[:4] + list(range(70, 78)))
    blocks = [replace(s, branch=d.hashes[0]) for s, _, _ in d.kv_items(12)]
    got = h.store.offer(ns.id, [blocks[1], blocks[1], blocks[2]])
    assert [(r.status, r.fork, r.branch) for r in got] == [
        ("want", True, None), ("have", True, None), ("elsewhere", False, d.hashes[1])]


def test_an_item_too_large_for_the_arena_does_not_end_the_offer(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A 128-byte arena: a block (256 bytes) can never fit, a one-token tail (64 bytes) can; the
    tail after the refused block is still taken."""
    h = harness(ram_only(ram_bytes=128), ns)
    block = Prompt(ns, A).kv_items(4)[0][0]
    tail = Prompt(ns, C).kv_items(1)[0][0]
    got = h.store.offer(ns.id, [block, tail])
    assert [(d.status, d.reason) for d in got] == [("rejected", Reason.TOO_LARGE), ("want", Reason.NONE)]


def test_an_owner_keeps_up_to_max_offers_per_tenant_wanted_offers(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """max_offers_per_tenant = 2: two wanted offers are both held; a third forgets the oldest."""
    h = harness(ram_only(max_offers_per_tenant=2), ns)
    owner = h.store.owner_of(ns)
    items = [Prompt(ns, t).kv_items(1)[0][0] for t in (A, C, [99])]  # three one-token tails under the root
    assert [d.status for d in h.store.offer(ns.id, items[:2])] == ["want", "want"]
    assert h.store.held_by(owner)["offers"] == 2
    assert [d.status for d in h.store.offer(ns.id, items[2:])] == ["want"]
    assert h.store.held_by(owner)["offers"] == 2


def test_an_item_refused_by_admission_does_not_end_the_offer(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """kv_admission second-hit: C's tail, offered once before, is wanted on its second sighting
    even after A's block, seen for the first time, is refused in the same offer."""
    h = harness(ram_only(kv_admission="second-hit"), ns)
    block = Prompt(ns, A).kv_items(4)[0][0]
    tail = Prompt(ns, C).kv_items(1)[0][0]
    assert [(d.status, d.reason) for d in h.store.offer(ns.id, [tail])] == [("rejected", Reason.ADMISSION)]
    got = h.store.offer(ns.id, [block, tail])
    assert [(d.status, d.reason) for d in got] == [("rejected", Reason.ADMISSION), ("want", Reason.NONE)]


def test_a_wanted_offer_is_kept_until_pending_ttl_s_and_not_past_it(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """docs/design.md: pending entries (and remembered offers) expire after pending_ttl_s."""
    h = harness(ram_only(pending_ttl_s=5.0), ns)
    owner = h.store.owner_of(ns)
    assert [d.status for d in h.store.offer(ns.id, [Prompt(ns, A).kv_items(4)[0][0]])] == ["want"]
    h.now[0] += 4.99
    h.store.sweep()
    assert h.store.held_by(owner)["offers"] == 1
    h.now[0] += 0.02  # 5.01 s
    h.store.sweep()
    assert h.store.held_by(owner)["offers"] == 0


def test_with_a_disk_tier_a_put_into_ram_full_of_leased_entries_is_refused_then_demotes(ns, harness, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The arena holds one block, written through to LMDB and leased by a lookup: nothing may be
    demoted, so another chain's put is refused (RAM_PINNED) and nothing is lost; once the lease is
    released the same put demotes the block (still on disk) and is taken."""
    h = harness(StoreConfig(port=0, data_dir=str(tmp_path), ram_bytes=256, page_bytes=64, durability="sync",
                            eviction="lru"), ns)
    h.save(A[:4], 4)
    _, looked = h.lookup(A[:4])
    assert looked.kv_tokens == 4 and looked.lease_id
    other = [90, 91, 92, 93]
    (spec, a, b), = Prompt(ns, other).kv_items(4)
    refused = h.store.plan_put(ns.id, [with_payload(spec, kv_payload(ns, other, a, b))])
    assert [(r.status, r.reason) for r in refused.results] == [("rejected", Reason.RAM_PINNED)]
    assert h.lookup(A[:4], lease=False)[1].kv_tokens == 4
    assert h.store.release(looked.lease_id)
    assert h.save(other, 4)["committed"] == 1
    assert h.lookup(A[:4], lease=False)[1].kv_tokens == 4 and h.lookup(other, lease=False)[1].kv_tokens == 4
    h.store.check()


def test_past_max_entries_a_commit_deletes_an_unleased_leaf_never_a_leased_one(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """max_entries = 2: two one-block chains held, the first leased. A third chain's commit makes
    room by deleting the unleased one; the leased one stays readable."""
    h = harness(ram_only(max_entries=2), ns)
    leased, other, third = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    h.save(leased, 4)
    _, looked = h.lookup(leased)
    assert looked.lease_id
    h.now[0] += 1.0
    h.save(other, 4)
    h.now[0] += 1.0
    assert h.save(third, 4)["committed"] == 1
    assert [h.lookup(t, lease=False)[1].kv_tokens for t in (leased, other, third)] == [4, 0, 4]
    h.store.check()
