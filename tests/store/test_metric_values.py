"""Exact metric values after scripted sequences: the split KV / state counters operators watch.

Each test runs a short script whose answer is worked out by hand in its comments,
then asserts every labelled value, not that a counter moved. Through the Store's
public methods (offer / plan_put / commit / lookup, tests/store/harness.py) and
its metrics registry, and once through a real aiohttp app scraped over HTTP.

The namespace (tests/factories.py): B = 4 tokens, 64 bytes of KV per token (a
block is 256 bytes), a 16-byte snapshot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from prefixstore.protocol import Namespace
from prefixstore.store import Store, StoreConfig

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload
from .harness import CoreHarness

KINDS = ("kv", "state")
TIERS = ("ram", "disk")


def value(store: Store, name: str, **labels: str) -> float:
    v = store.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def lookup_tokens(store: Store) -> dict[tuple[str, str], float]:
    return {(k, r): value(store, "prefixstore_lookup_tokens_total", kind=k, result=r)
            for k in KINDS for r in ("hit", "miss")}


def gauges(store: Store, name: str) -> dict[tuple[str, str], float]:
    return {(k, t): value(store, name, kind=k, tier=t) for k in KINDS for t in TIERS}


def counters(store: Store, name: str, label: str, values: tuple[str, ...]) -> dict[tuple[str, str], float]:
    return {(k, v): value(store, name, kind=k, **{label: v}) for k in KINDS for v in values}


@pytest.fixture
def ns() -> Namespace:
    return make_namespace(block_tokens=4)


@pytest.fixture
def harness():  # type: ignore[no-untyped-def]
    made: list[CoreHarness] = []

    def make(config: StoreConfig, ns: Namespace) -> CoreHarness:
        made.append(CoreHarness(config, ns))
        return made[-1]

    yield make
    for h in made:
        h.close()


def ram_only(ram_bytes: int = 1 << 20, page_bytes: int = 64, **kw: object) -> StoreConfig:
    kw = {"eviction": "lru", "state_admission": "always", **kw}
    return StoreConfig(port=0, data_dir="none", ram_bytes=ram_bytes, page_bytes=page_bytes, **kw)  # type: ignore[arg-type]


A = list(range(1, 11))  # 10 tokens: blocks [1..4], [5..8], tail [9, 10]


def test_lookup_tokens_split_by_kind_and_result(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    h.save(A, 10, {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
    assert lookup_tokens(h.store) == {(k, r): 0.0 for k in KINDS for r in ("hit", "miss")}

    _, a = h.lookup(A + [90, 91])  # 12 tokens: KV and a snapshot for the first 10
    assert (a.kv_tokens, a.state_tokens) == (10, 10)
    _, a = h.lookup(A[:6] + [50, 51])  # 8 tokens: KV for 6 (inside block 2), a snapshot at 4
    assert (a.kv_tokens, a.state_tokens) == (6, 4)
    _, a = h.lookup([7, 7, 7])  # nothing
    assert (a.kv_tokens, a.state_tokens) == (0, 0)

    assert lookup_tokens(h.store) == {
        ("kv", "hit"): 10 + 6 + 0, ("kv", "miss"): 2 + 2 + 3,
        ("state", "hit"): 10 + 4 + 0, ("state", "miss"): 2 + 4 + 3,
    }
    assert value(h.store, "prefixstore_lookups_total") == 3


def test_a_namespace_without_state_counts_kv_tokens_only(harness) -> None:  # type: ignore[no-untyped-def]
    ns = make_namespace(block_tokens=4, with_state=False, model="kv-only")
    h = harness(ram_only(), ns)
    h.save(A[:8], 8)
    _, a = h.lookup(A)  # 10 tokens, 8 stored
    assert a.kv_tokens == 8
    assert lookup_tokens(h.store) == {("kv", "hit"): 8, ("kv", "miss"): 2, ("state", "hit"): 0, ("state", "miss"): 0}


def test_stored_bytes_and_entries_by_kind_and_tier(ns, harness, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    # RAM only: two blocks (256 B each) and a tail of 2 tokens (128 B); two snapshots (16 B each).
    h = harness(ram_only(), ns)
    h.save(A, 10, {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
    assert gauges(h.store, "prefixstore_stored_bytes") == {
        ("kv", "ram"): 2 * 256 + 128, ("kv", "disk"): 0, ("state", "ram"): 32, ("state", "disk"): 0}
    assert gauges(h.store, "prefixstore_entries") == {
        ("kv", "ram"): 3, ("kv", "disk"): 0, ("state", "ram"): 2, ("state", "disk"): 0}

    # LMDB: every committed entry is on disk too (once written); RAM holds what fits.
    # 12 pages of 64 B: the three KV entries (4 + 4 + 2 pages) and both snapshots (1 each).
    d = harness(StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=12 * 64, page_bytes=64,
                            disk_bytes=1 << 20, eviction="lru", state_admission="always"), ns)
    d.save(A, 10, {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
    d.drain()  # durability=write-behind: on disk once the writer has been
    assert gauges(d.store, "prefixstore_stored_bytes") == {
        ("kv", "ram"): 640, ("kv", "disk"): 640, ("state", "ram"): 32, ("state", "disk"): 32}
    # One more 2-block sequence needs 8 of the 12 pages: entries are demoted (RAM only;
    # they stay on disk) until 8 pages are free. Entries of one save share their last
    # access, so which of them go is the queue's tie order; what the counters must say
    # is that RAM + demoted = disk for each kind, and RAM bytes fit the 12 pages.
    d.now[0] += 1.0
    d.save([200] * 8, 8)
    d.store.check()  # the new sequence, behind the writer: in RAM only, not demotable
    d.drain()
    entries = gauges(d.store, "prefixstore_entries")
    held = gauges(d.store, "prefixstore_stored_bytes")
    demoted = counters(d.store, "prefixstore_evictions_total", "reason", ("demoted", "capacity"))
    assert (entries[("kv", "disk")], entries[("state", "disk")]) == (5, 2)
    assert (held[("kv", "disk")], held[("state", "disk")]) == (4 * 256 + 128, 32)
    for kind in KINDS:
        assert entries[(kind, "ram")] + demoted[(kind, "demoted")] == entries[(kind, "disk")]
        assert demoted[(kind, "capacity")] == 0
    assert held[("kv", "ram")] + held[("state", "ram")] <= 12 * 64
    assert held[("kv", "ram")] >= 2 * 256  # the new sequence is in RAM
    d.store.check()


def test_capacity_evictions_by_kind(ns, harness) -> None:  # type: ignore[no-untyped-def]
    # 16 pages of 64 B, LRU, RAM only. Sequence A takes 4 + 4 + 2 KV pages and 2 snapshot pages.
    h = harness(ram_only(ram_bytes=16 * 64), ns)
    h.save(A, 10, {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
    h.now[0] += 1.0
    # 8 more pages for [200]*8: 4 are free, 4 must go. Leaf-first from the least recent:
    # the snapshot at 10 (1), the tail (2), the snapshot at 4 (1).
    h.save([200] * 8, 8)
    assert counters(h.store, "prefixstore_evictions_total", "reason", ("capacity", "demoted")) == {
        ("kv", "capacity"): 1, ("kv", "demoted"): 0, ("state", "capacity"): 2, ("state", "demoted"): 0}
    assert gauges(h.store, "prefixstore_entries") == {
        ("kv", "ram"): 4, ("kv", "disk"): 0, ("state", "ram"): 0, ("state", "disk"): 0}
    _, a = h.lookup(A)
    assert (a.kv_tokens, a.state_tokens) == (8, 0)  # what the counters say is what lookups see
    h.store.check()


def test_admission_decisions_by_kind(ns, harness) -> None:  # type: ignore[no-untyped-def]
    # state_admission second-hit: a snapshot's first offer is refused, its second wanted.
    h = harness(ram_only(state_admission="second-hit"), ns)
    first = h.save(A, 10, {10: state_payload(ns, A, 10)})
    # offer: 3 KV want, 1 state rejected; put: the 3 KV want.
    assert first == {"offered": 4, "wanted": 3, "have": 0, "committed": 3}
    second = h.save(A, 10, {10: state_payload(ns, A, 10)})
    # offer: 3 KV have, 1 state want; put: 1 state want.
    assert second == {"offered": 4, "wanted": 1, "have": 3, "committed": 1}
    assert counters(h.store, "prefixstore_admission_total", "decision", ("want", "have", "rejected")) == {
        ("kv", "want"): 3 + 3, ("kv", "have"): 3, ("kv", "rejected"): 0,
        ("state", "want"): 1 + 1, ("state", "have"): 0, ("state", "rejected"): 1}


def test_a_lookup_sighting_makes_second_hit_admit_the_first_offer(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """lookup -> sighting -> admission through the real store: KV of 10 tokens is stored
    without a snapshot; a lookup that reaches it is the junction's second sighting
    (``checkpoint_hint``), so the snapshot the engine then offers is admitted at once."""
    h = harness(ram_only(state_admission="second-hit"), ns)
    h.save(A, 10)
    control = h.store.offer(ns.id, [h_prompt_state(h, A[:8], 8)])  # never looked up: a first sighting
    assert [d.status for d in control] == ["rejected"]
    _, a = h.lookup(A + [77])
    assert (a.kv_tokens, a.state_tokens, a.checkpoint_hint) == (10, 0, 10)
    decided = h.store.offer(ns.id, [h_prompt_state(h, A, 10)])
    assert [d.status for d in decided] == ["want"]
    assert value(h.store, "prefixstore_admission_total", kind="state", decision="want") == 1
    assert value(h.store, "prefixstore_admission_total", kind="state", decision="rejected") == 1


def h_prompt_state(h: CoreHarness, tokens: list[int], t: int):  # type: ignore[no-untyped-def]
    from prefixstore.client.prompt import Prompt

    return Prompt(h.ns, tokens).state_item(t, len(tokens))


async def test_metric_values_over_http(running: RunningStore, namespace: Namespace) -> None:
    """The same counters scraped from a real app's /metrics after a client's saves and lookups."""
    import aiohttp

    ns = namespace  # B = 4, as above
    async with running.client(ns) as c:
        p = c.prompt(A)
        saved = await c.save(p, 10, lambda a, b: kv_payload(ns, A, a, b),
                             {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
        assert saved.stored == 5
        r1 = await c.lookup(A + [90, 91], lease=False)
        r2 = await c.lookup(A[:6] + [50, 51], lease=False)
        assert (r1.kv_tokens, r1.state_tokens, r2.kv_tokens, r2.state_tokens) == (10, 10, 6, 4)
    # durability=write-behind: the disk series count what the writer has written by the scrape, so
    # wait for it first (without this the disk figures raced the writer: 0 on a loaded machine).
    await running.store.drain_writes()
    async with aiohttp.ClientSession() as s, s.get(running.url + "/metrics") as resp:
        text = await resp.text()
    samples = {(m.name, tuple(sorted(m.labels.items()))): m.value
               for f in text_string_to_metric_families(text) for m in f.samples}

    def get(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert {(k, r): get("prefixstore_lookup_tokens_total", kind=k, result=r) for k in KINDS for r in ("hit", "miss")} \
        == {("kv", "hit"): 16, ("kv", "miss"): 4, ("state", "hit"): 14, ("state", "miss"): 6}
    assert {(k, t): get("prefixstore_stored_bytes", kind=k, tier=t) for k in KINDS for t in TIERS} \
        == {("kv", "ram"): 640, ("kv", "disk"): 640, ("state", "ram"): 32, ("state", "disk"): 32}
    assert {(k, t): get("prefixstore_entries", kind=k, tier=t) for k in KINDS for t in TIERS} \
        == {("kv", "ram"): 3, ("kv", "disk"): 3, ("state", "ram"): 2, ("state", "disk"): 2}
    # The client offers, then puts what was wanted: each wanted item is counted at both steps.
    assert {(k, d): get("prefixstore_admission_total", kind=k, decision=d) for k in KINDS
            for d in ("want", "have", "rejected")} == {
        ("kv", "want"): 6, ("kv", "have"): 0, ("kv", "rejected"): 0,
        ("state", "want"): 4, ("state", "have"): 0, ("state", "rejected"): 0}


def test_a_fresh_store_exports_every_series_at_its_initial_value(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """Metric names and labels are public API: dashboards and alerts query series that must
    exist (at zero) before the first event, and the gauges start at what the node is."""
    h = harness(ram_only(ram_bytes=64 * 64), ns)
    s = h.store
    for kind in KINDS:
        for result in ("hit", "miss"):
            assert s.metrics.registry.get_sample_value(
                "prefixstore_lookup_tokens_total", {"kind": kind, "result": result}) == 0.0
        assert s.metrics.registry.get_sample_value("prefixstore_replicas", {"kind": kind}) == 0.0
    for direction in ("in", "out"):
        for path in ("http", "nixl"):
            assert s.metrics.registry.get_sample_value(
                "prefixstore_transfer_bytes_total", {"direction": direction, "path": path}) == 0.0
    for result in ("ok", "failed", "skipped"):
        assert value(s, "prefixstore_replication_pushes_total", result=result) == 0.0 and \
            s.metrics.registry.get_sample_value("prefixstore_replication_pushes_total", {"result": result}) is not None
    for how in ("map", "promoted"):
        assert s.metrics.registry.get_sample_value("prefixstore_nixl_disk_reads_total", {"how": how}) == 0.0
    assert value(s, "prefixstore_data_path", path="http") == 1.0
    assert s.metrics.registry.get_sample_value("prefixstore_data_path", {"path": "nixl"}) == 0.0
    assert value(s, "prefixstore_members") == 1.0
    assert value(s, "prefixstore_arena_capacity_bytes") == 64 * 64
    assert value(s, "prefixstore_arena_free_bytes") == 64 * 64
    assert s.metrics.registry.get_sample_value("prefixstore_pending_entries") == 0.0
    s.metrics.latency.labels("lookup").observe(0.0003)
    buckets = sorted(float(m.labels["le"]) for f in s.metrics.registry.collect()
                     if f.name == "prefixstore_request_duration_seconds" for m in f.samples
                     if m.name.endswith("_bucket") and m.labels.get("endpoint") == "lookup")
    assert buckets == [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
                       5.0, float("inf")]
    described = {f.name for f in s.metrics.registry.collect()}
    assert {"prefixstore_stored_bytes", "prefixstore_entries", "prefixstore_leases"} <= described
