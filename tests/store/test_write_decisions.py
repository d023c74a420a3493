"""Offer and put decisions item by item, and their counters, for batches that mix outcomes.

Written against survivors of a mutation sample of store/writes.py (docs/testing.md): a
rejected item must not end the batch, a put carrying an item the store already has or
cannot take still reserves the rest and counts each decision, and a wanted offer is
forgotten pending_ttl_s after it was made. Same namespace as test_metric_values.py.
"""

from __future__ import annotations

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol.wire import STATUS_OK
from prefixstore.store import StoreConfig

from ..factories import kv_payload, make_namespace
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
    assert [(d.status, d.reason) for d in got] == [("rejected", "parent not stored"), ("want", "")]
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
        ("rejected", "RAM arena full of pinned or uncommitted entries")]
    assert counters(h.store, "prefixstore_admission_total", "decision", DECISIONS)[("kv", "rejected")] == before + 1
    assert plan.keys == []
    assert h.lookup(A[:8], lease=False)[1].kv_tokens == 4


def test_an_item_larger_than_the_arena_is_refused_one_that_fills_it_is_taken(harness) -> None:  # type: ignore[no-untyped-def]
    big = make_namespace(block_tokens=8)  # a block is 512 bytes
    h = harness(ram_only(ram_bytes=512), big)
    got = h.store.offer(big.id, [Prompt(big, A[:8]).kv_items(8)[0][0]])
    assert [(d.status, d.reason) for d in got] == [("want", "")]
    small = harness(ram_only(ram_bytes=256), big)
    got = small.store.offer(big.id, [Prompt(big, A[:8]).kv_items(8)[0][0]])
    assert [(d.status, d.reason) for d in got] == [("rejected", "larger than the RAM arena")]


def test_a_reserved_put_survives_a_sweep_until_pending_ttl(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(pending_ttl_s=5.0), ns)
    keys, _ = h.stage(A[:4], 4)
    h.now[0] += 4.0
    h.store.sweep()  # 4 s of 5: still pending
    assert [r.status for r in h.run(h.store.commit(ns.id, keys))] == [STATUS_OK]
    keys, _ = h.stage(A[:8], 8)
    h.now[0] += 6.0
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
