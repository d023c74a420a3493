"""Store core behaviour: leases, pins during reads, pending visibility, offers, tier moves."""

from __future__ import annotations

import asyncio

from pathlib import Path

import numpy as np

import pytest

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import Kind
from prefixstore.protocol.keys import make_entry_key
from prefixstore.protocol.probe import ProbeRequest
from prefixstore.protocol.errors import Problem, Reason
from prefixstore.protocol.wire import STATUS_OK, WANT, GetItem, WireError
from prefixstore.store import StoreConfig

from ..factories import head_slice, kv_payload, make_headed_namespace, make_namespace, state_head_slice, state_payload
from ..samples import sample
from .harness import CoreHarness, expected_prefix_bytes, fill_target


def ram_only(ram_bytes: int = 64 * 256, **kw: object) -> StoreConfig:
    """A RAM-only store with the baseline policies (recency order is what these tests reason about)."""
    kw = {"eviction": "lru", "state_admission": "always", **kw}
    return StoreConfig(port=0, data_dir="none", ram_bytes=ram_bytes, page_bytes=256, **kw)  # type: ignore[arg-type]


@pytest.fixture
def ns():  # type: ignore[no-untyped-def]
    return make_namespace(block_tokens=4)


@pytest.fixture
def harness():  # type: ignore[no-untyped-def]
    """Factory for harnesses that are closed at teardown, pass or fail."""
    made: list[CoreHarness] = []

    def make(config: StoreConfig, ns):  # type: ignore[no-untyped-def]
        made.append(CoreHarness(config, ns))
        return made[-1]

    yield make
    for h in made:
        h.close()


def fill(h: CoreHarness, n: int, start: int = 1000) -> None:
    """Save n unrelated 8-token sequences (2 blocks, 512 bytes each)."""
    for i in range(n):
        h.now[0] += 0.1  # a moving clock, so recency orders the entries
        h.save([start + i] * 8, 8)


def test_leased_entries_survive_eviction_pressure_until_released(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    toks = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    h.save(toks, 10, {9: state_payload(ns, toks, 9)})
    _, ans = h.lookup(toks)
    assert (ans.kv_tokens, ans.state_tokens) == (10, 9) and ans.lease_id
    fill(h, 40)  # 40 x 512 B through a 16 KiB arena: everything unleased is evicted
    h.store.check()
    _, again = h.lookup(toks, lease=False)
    assert (again.kv_tokens, again.state_tokens) == (10, 9)
    kv, snap = h.read_prefix(toks, again, 10)
    assert kv == expected_prefix_bytes(ns, toks, 10, 4) and snap == state_payload(ns, toks, 9)
    assert h.store.release(ans.lease_id)
    fill(h, 40, start=5000)
    _, gone = h.lookup(toks, lease=False)
    assert gone.kv_tokens < 10
    h.store.check()


def test_a_probe_leases_the_deepest_block_of_the_run_its_binary_search_found(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A cluster hop (``probe``) of a 13-block prompt takes the fast path (binary search of the held
    run, store/lookups.py): its lease must still hold the deepest held block -- eviction is leaf-
    first, so that one lease keeps the whole run -- and the snapshot with it, until released. The
    prompt ends on a block boundary: no tail child whose own lease would keep the run anyway."""
    h = harness(ram_only(), ns)
    toks = list(range(1, 53))  # 13 full blocks
    h.save(toks, 52, {20: state_payload(ns, toks, 20)})  # its container (block 5) is not the deepest
    p = Prompt(ns, toks)

    def probe(lease: bool):  # type: ignore[no-untyped-def]
        return h.store.probe(ProbeRequest(namespace_id=ns.id, start=0, parent=p.parent_of_block(0),
                                          hashes=b"".join(p.hashes), tokens=p.packed, lease=lease))

    ans = probe(True)
    assert (ans.held, ans.lease_id is not None, 4 in ans.snapshots) == (13, True, True), ans
    fill(h, 40)  # 40 x 512 B through a 16 KiB arena: everything unleased is evicted
    h.store.check()
    again = probe(False)
    assert (again.held, again.snapshots[4].usable_tokens) == (13, 20)
    _, look = h.lookup(toks, lease=False)
    kv, snap = h.read_prefix(toks, look, 52)
    assert kv == expected_prefix_bytes(ns, toks, 52, 4) and snap == state_payload(ns, toks, 20)
    assert h.store.release(ans.lease_id)
    fill(h, 40, start=5000)
    assert probe(False).held < 13
    h.store.check()


def test_lease_expires_by_time_and_lookups_never_renew_it(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(lease_ttl_s=10.0), ns)
    toks = list(range(8))
    h.save(toks, 8)
    _, first = h.lookup(toks)
    h.now[0] += 6
    _, second = h.lookup(toks)
    h.now[0] += 5  # first lease is 11 s old, second 5 s
    h.store.sweep()
    assert not h.store.leases.holds(first.lease_id)
    assert h.store.leases.holds(second.lease_id)
    h.now[0] += 6
    h.store.sweep()
    assert not h.store.leases.holds(second.lease_id)
    assert len(h.store.leases) == 0
    assert all(e.pins == 0 for e in h.store.index.entries.values())


def test_eviction_during_a_read_never_changes_the_bytes_being_sent(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    toks = [7] * 8
    h.save(toks, 8)
    p = Prompt(ns, toks)
    plan = h.run(h.store.prepare_get(ns.id, [GetItem(key=p.block_key(0)), GetItem(key=p.block_key(1))]))
    views = [h.store.payload_views(s) for s in plan.slots]
    fill(h, 60)  # would reuse those pages if the read did not pin them
    sent = [b"".join(bytes(v) for v in vs) for vs in views]
    assert sent == [kv_payload(ns, toks, 0, 4), kv_payload(ns, toks, 4, 8)]
    h.store.finish_get(plan)
    h.store.check()


def test_uncommitted_puts_are_invisible_and_expire(ns, harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = StoreConfig(port=0, data_dir=str(tmp_path), ram_bytes=1 << 20, page_bytes=256, pending_ttl_s=5.0)
    h = harness(cfg, ns)
    toks = [3] * 6
    p = Prompt(ns, toks)
    specs = [with_payload(s, kv_payload(ns, toks, a, b)) for s, a, b in p.kv_items(6)]
    free_before = h.store.arena.num_free
    plan = h.store.plan_put(ns.id, specs)
    for target, (s, a, b) in zip(plan.targets, p.kv_items(6)):
        assert target is not None
        fill_target(target, kv_payload(ns, toks, a, b))
    h.store.verify_put(plan)
    assert h.lookup(toks, lease=False)[1].kv_tokens == 0  # put, not committed: invisible
    h.now[0] += 6
    h.store.sweep()
    assert h.store.arena.num_free == free_before and not h.store.pending
    assert [r.status for r in h.run(h.store.commit(ns.id, plan.keys))] == ["missing"] * 2
    assert h.lookup(toks, lease=False)[1].kv_tokens == 0
    h.store.check()


def test_offer_answers_want_have_rejected(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(ram_bytes=1 << 20), ns)
    toks = list(range(12))
    h.save(toks, 4)
    p = Prompt(ns, toks)
    orphan = Prompt(ns, [99] * 12).kv_items(12)[2][0]  # block 3 of a chain never stored
    specs = [s for s, _, _ in p.kv_items(12)] + [orphan]
    assert [r.status for r in h.store.offer(ns.id, specs)] == ["have", WANT, WANT, "rejected"]
    assert h.store.offer(ns.id, [orphan])[0].reason is Reason.PARENT_MISSING


def test_ram_eviction_with_lmdb_demotes_and_reads_promote(ns, harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    cfg = StoreConfig(port=0, data_dir=str(tmp_path), ram_bytes=16 * 256, page_bytes=256)
    h = harness(cfg, ns)
    seqs = [[i] * 8 for i in range(20)]
    for s in seqs:
        assert h.save(s, 8)["committed"] == 2
    h.store.check()  # entries behind the write-behind: only in RAM, never demoted
    h.drain()
    stats = h.store.stats()
    assert stats["entries"]["kv/disk"] == 40 and stats["entries"]["kv/ram"] < 40  # type: ignore[index]
    for s in seqs:  # every one still exact, read back from disk into RAM
        _, ans = h.lookup(s, lease=False)
        assert ans.kv_tokens == 8
        kv, _ = h.read_prefix(s, ans, 8)
        assert kv == expected_prefix_bytes(ns, s, 8, 4)
    demoted = sample(h.store, "prefixstore_evictions_total", kind="kv", reason="demoted")
    assert demoted > 0
    h.store.check()


@pytest.mark.parametrize("failure", [RuntimeError("the tier failed"), asyncio.CancelledError()],
                         ids=["tier-error", "cancelled"])
def test_a_get_that_fails_reading_disk_leaves_no_pins_and_no_pages(ns, harness, tmp_path: Path,
                                                                   failure: BaseException) -> None:  # type: ignore[no-untyped-def]
    """A get whose promotion from LMDB fails (the tier raises, or the request is cancelled while it
    waits on the read) releases every pin it took and the pages it allocated for the promotion:
    nothing stays unevictable and the arena's accounting holds (Store.check)."""
    cfg = StoreConfig(port=0, data_dir=str(tmp_path), ram_bytes=16 * 256, page_bytes=256)
    h = harness(cfg, ns)
    seqs = [[i] * 8 for i in range(20)]
    for sq in seqs:
        assert h.save(sq, 8)["committed"] == 2
    h.drain()
    h.save([99] * 8, 8)  # pushes the oldest out of RAM once they are in LMDB
    h.drain()
    cold = [e for e in h.store.index.entries.values() if e.pages is None and e.on_disk]
    assert cold, "nothing was demoted: the test needs disk-only entries"
    tier = h.store.disk.tier
    assert tier is not None

    async def broken(*args: object, **kwargs: object) -> str:
        raise failure

    real, tier.read_into = tier.read_into, broken  # type: ignore[method-assign]
    try:
        items = [GetItem(key=e.wire_key) for e in h.store.index.entries.values() if e.pages is not None][:2]
        items.append(GetItem(key=cold[0].wire_key))
        with pytest.raises(type(failure)):
            h.run(h.store.prepare_get(ns.id, items))
    finally:
        tier.read_into = real  # type: ignore[method-assign]
    assert not any(e.pins for e in h.store.index.entries.values())
    held = sum(len(e.pages) for e in h.store.index.entries.values() if e.pages is not None)
    assert held + h.store.arena.num_free == h.store.arena.num_pages, "pages neither held nor free: leaked"
    h.store.check()


def test_snapshot_goes_before_its_block_under_pressure(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    toks = [5, 5, 5, 5]
    h.save(toks, 4, {2: state_payload(ns, toks, 2), 4: state_payload(ns, toks, 4)})
    for i in range(60):
        h.save([2000 + i] * 4, 4)
        h.store.check()  # includes: every snapshot's container is stored
        block = h.store.entry(ns.id, Prompt(ns, toks).block_key(0))
        states = [e for e in h.store.index.entries.values() if e.kind is Kind.STATE]
        if block is None:
            assert not states


def test_layer_range_reads(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(ram_bytes=1 << 20), ns)
    toks = [1, 2, 3, 4]
    h.save(toks, 4)
    key = Prompt(ns, toks).block_key(0)
    full = kv_payload(ns, toks, 0, 4)
    per_layer = 4 * ns.kv.layer_token_bytes
    (layer1,) = h.read([GetItem(key=key, layer_start=1, layer_end=2)])
    assert layer1 == full[per_layer : 2 * per_layer]
    plan = h.run(h.store.prepare_get(ns.id, [GetItem(key=key, layer_start=1, layer_end=2)]))
    import xxhash

    assert plan.slots[0].status == STATUS_OK and plan.slots[0].checksum == xxhash.xxh3_64_intdigest(layer1)
    h.store.finish_get(plan)


@pytest.mark.parametrize("page_bytes", [256, 64], ids=["page-per-block", "block-over-pages"])
def test_head_range_reads(harness, page_bytes: int) -> None:  # type: ignore[no-untyped-def]
    """An engine at TP=2 reads its own heads of an entry written whole: each rank's bytes are the
    heads' rows of every layer and component (KV) and of every tensor (state), cut here with numpy
    from the layout's description, and their checksum is the xxh3 of exactly those bytes."""
    import xxhash

    ns = make_headed_namespace(block_tokens=4)
    h = harness(StoreConfig(port=0, data_dir="none", ram_bytes=1 << 20, page_bytes=page_bytes,
                            eviction="lru", state_admission="always"), ns)
    toks = [1, 2, 3, 4, 5, 6]
    h.save(toks, 6, {6: state_payload(ns, toks, 6)})
    p = Prompt(ns, toks)
    block, tail = p.block_key(0), p.kv_key_ending_at(6)
    snap = make_entry_key(Kind.STATE, p.prefix_hash(6))
    for rank in (0, 1):
        heads = (2 * rank, 2 * rank + 2)
        items = [GetItem(key=block, head_start=heads[0], head_end=heads[1]),
                 GetItem(key=tail, head_start=heads[0], head_end=heads[1]),
                 GetItem(key=block, layer_start=1, layer_end=2, head_start=heads[0], head_end=heads[1]),
                 GetItem(key=snap, head_start=heads[0], head_end=heads[1])]
        want = [head_slice(ns, kv_payload(ns, toks, 0, 4), 4, heads),
                head_slice(ns, kv_payload(ns, toks, 4, 6), 2, heads),
                head_slice(ns, kv_payload(ns, toks, 0, 4), 4, heads, layers=(1, 2)),
                state_head_slice(ns, state_payload(ns, toks, 6), heads)]
        assert h.read(items) == want
        plan = h.run(h.store.prepare_get(ns.id, items))
        try:
            assert [s.checksum for s in plan.slots] == [xxhash.xxh3_64_intdigest(w) for w in want]
        finally:
            h.store.finish_get(plan)
    # Both ranks' heads side by side are the whole payload's heads: nothing lost, nothing doubled.
    halves = [h.read([GetItem(key=block, head_start=a, head_end=a + 2)])[0] for a in (0, 2)]
    whole = np.frombuffer(kv_payload(ns, toks, 0, 4), np.uint8).reshape(2, 2, 4, -1)
    assert np.array_equal(np.concatenate([np.frombuffer(x, np.uint8).reshape(2, 2, 2, -1) for x in halves], axis=2),
                          whole)


def test_a_get_over_max_get_bytes_is_refused_before_anything_is_hashed(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """An attacker's get of one layer range repeated past max_get_bytes: 413 naming the field, and
    not one range hashed first (the budget is checked in the pass that pins, the hashing after it)."""
    h = harness(ram_only(ram_bytes=1 << 20, max_get_bytes=64 * 1024), ns)
    toks = [1, 2, 3, 4]
    h.save(toks, 4)
    item = GetItem(key=Prompt(ns, toks).block_key(0), layer_start=1, layer_end=2)
    per_item = 4 * ns.kv.layer_token_bytes
    hashed: list[int] = []
    real = h.store.arena.checksum_runs

    def counting(pages: list[int], ranges: list[tuple[int, int]]) -> int:
        hashed.append(sum(n for _, n in ranges))
        return real(pages, ranges)

    h.store.arena.checksum_runs = counting  # type: ignore[method-assign]
    for field, want in (("items", "items"), ("layers", "keys")):
        with pytest.raises(WireError) as info:
            h.run(h.store.prepare_get(ns.id, [item] * (64 * 1024 // per_item + 1), field=field))
        assert info.value.problem is Problem.TOO_LARGE and info.value.field == want
    assert hashed == []
    assert not any(e.pins for e in h.store.index.entries.values())


def test_extra_keys_separate_tails_and_snapshots(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A tail stored under one LoRA / image must not serve a prompt with another one."""
    h = harness(ram_only(ram_bytes=1 << 20), ns)
    toks = [1, 2, 3, 4, 5, 6]  # block 0 full, block 1 is a 2-token tail
    lora_a, lora_b = [b"", b"lora:a"], [b"", b"lora:b"]
    h.save(toks, 6, {5: state_payload(ns, toks, 5)}, extra_keys=lora_a)
    assert (lambda a: (a.kv_tokens, a.state_tokens))(h.lookup(toks, extra_keys=lora_a)[1]) == (6, 5)
    other = h.lookup(toks, extra_keys=lora_b)[1]
    assert (other.kv_tokens, other.state_tokens) == (4, 0)
    plain = h.lookup(toks)[1]
    assert (plain.kv_tokens, plain.state_tokens) == (4, 0)


def test_a_deleted_pinned_entry_frees_its_pages_even_if_its_key_is_put_again(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """Regression: the pages of an entry removed while a read pinned it are freed when
    the read ends — also when a new put of the same key is pending meanwhile."""
    h = harness(ram_only(ram_bytes=1 << 20), ns)
    toks = [9, 9, 9, 9]
    h.save(toks, 4)
    free_after_save = h.store.arena.num_free
    key = Prompt(ns, toks).block_key(0)
    plan = h.run(h.store.prepare_get(ns.id, [GetItem(key=key)]))
    old = h.store.entry(ns.id, key)
    assert old is not None
    h.store.delete(old, "corrupt")  # e.g. a corruption cascade while the read streams
    spec = with_payload(Prompt(ns, toks).kv_items(4)[0][0], kv_payload(ns, toks, 0, 4))
    put = h.store.plan_put(ns.id, [spec])  # the same key, pending again
    assert put.entries[0] is not None and h.store.pending_entry(ns.id, key) is put.entries[0]
    h.store.finish_get(plan)
    assert old.pages is None  # freed once the last pin dropped
    assert h.store.arena.num_free == free_after_save  # old pages back, the new put holds its own
    h.store.abort_put(put)
    h.store.check()


def test_a_lease_holds_until_lease_ttl_s_and_not_past_it(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """docs/design.md: leases end on release or expiry (lease_ttl_s). Pinned on both sides of it."""
    h = harness(ram_only(lease_ttl_s=10.0), ns)
    toks = list(range(8))
    h.save(toks, 8)
    _, ans = h.lookup(toks)
    h.now[0] += 9.99
    h.store.sweep()
    assert h.store.leases.holds(ans.lease_id)
    h.now[0] += 0.02  # 10.01 s
    h.store.sweep()
    assert not h.store.leases.holds(ans.lease_id) and all(e.pins == 0 for e in h.store.index.entries.values())
