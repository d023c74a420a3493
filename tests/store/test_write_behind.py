"""durability=write-behind (store/behind.py) on a real Store core and LMDB tier: what is behind
the writer stays in RAM, batches share transactions, deletions and failures leave no wrong entry
on disk, the bound makes commits wait, and close drains."""

from __future__ import annotations

from pathlib import Path

import pytest

from prefixstore.store import StoreConfig

from ..factories import make_namespace
from .harness import CoreHarness, expected_prefix_bytes
from .test_metric_values import value


@pytest.fixture
def h(tmp_path: Path):  # type: ignore[no-untyped-def]
    made: list[CoreHarness] = []

    def make(**kw: object) -> CoreHarness:
        cfg = StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=64 * 256, page_bytes=256,
                          eviction="lru", **kw)  # type: ignore[arg-type]
        made.append(CoreHarness(cfg, make_namespace(block_tokens=4)))
        return made[-1]

    yield make
    for x in made:
        x.close()


SEQS = [[i] * 8 for i in range(1, 6)]  # five unrelated 2-block sequences


def disk_entries(x: CoreHarness) -> int:
    return int(value(x.store, "prefixstore_entries", kind="kv", tier="disk"))


def test_commits_share_transactions_and_stay_in_ram_until_written(h) -> None:  # type: ignore[no-untyped-def]
    x = h()
    staged = [x.stage(s, 8)[0] for s in SEQS]

    async def commit_all() -> None:  # five commits before the writer runs once
        for keys in staged:
            assert [r.status for r in await x.store.commit(x.ns.id, keys)] == ["ok", "ok"]

    x.run(commit_all())
    assert value(x.store, "prefixstore_write_behind_entries") > 0
    x.store.check()  # behind the writer: in RAM only, in no RAM queue (never demoted)
    assert all(e.pages is not None and not e.on_disk for e in x.store.behind.behind())
    x.drain()
    assert disk_entries(x) == 10 and value(x.store, "prefixstore_write_behind_written_total") == 10
    assert value(x.store, "prefixstore_write_behind_txns_total") == 1  # one transaction for five commits
    assert value(x.store, "prefixstore_write_behind_entries") == 0
    assert value(x.store, "prefixstore_write_behind_bytes") == 0
    x.store.check()
    x.restart()
    for s in SEQS:
        _, ans = x.lookup(s, lease=False)
        assert ans.kv_tokens == 8
        assert x.read_prefix(s, ans, 8)[0] == expected_prefix_bytes(x.ns, s, 8, 4)


def test_an_entry_deleted_before_it_is_written_never_reaches_lmdb(h) -> None:  # type: ignore[no-untyped-def]
    x = h()
    keys = x.stage(SEQS[0], 8)[0]

    async def commit_and_flush() -> None:
        await x.store.commit(x.ns.id, keys)
        assert x.store.flush() == 2  # before the writer took them

    x.run(commit_and_flush())
    x.drain()
    x.store.check()
    assert disk_entries(x) == 0
    x.restart()
    assert len(x.store.index.entries) == 0


def test_an_entry_deleted_while_its_transaction_is_in_flight_is_deleted_from_lmdb(h) -> None:  # type: ignore[no-untyped-def]
    x = h()
    real = x.store.disk.write
    seen: list[tuple[bool, int, bool]] = []

    async def write_then_flush(puts):  # type: ignore[no-untyped-def]
        in_flight = list(x.store.index.entries.values())
        x.store.flush()  # deleted while pinned by the writer: pages stay valid under the write
        seen.extend((e.dead, e.pins, e.pages is not None) for e in in_flight)
        return await real(puts)

    x.store.disk.write = write_then_flush  # type: ignore[method-assign]
    x.save(SEQS[0], 8)
    x.drain()
    x.store.disk.write = real  # type: ignore[method-assign]
    assert seen == [(True, 1, True)] * 2
    x.store.check()
    assert x.store.arena.num_free == x.store.arena.num_pages  # every page back
    x.restart()
    assert len(x.store.index.entries) == 0  # what the writer wrote was deleted after it


def test_a_failed_write_is_a_miss(h) -> None:  # type: ignore[no-untyped-def]
    x = h()

    async def fail(puts):  # type: ignore[no-untyped-def]
        raise OSError("disk gone")

    x.store.disk.write = fail  # type: ignore[method-assign]
    assert x.save(SEQS[0], 8)["committed"] == 2
    x.drain()
    _, ans = x.lookup(SEQS[0], lease=False)
    assert ans.kv_tokens == 0
    assert value(x.store, "prefixstore_evictions_total", kind="kv", reason="unpersisted") == 2
    x.store.check()


def test_commits_wait_while_the_writer_is_over_its_bound(h) -> None:  # type: ignore[no-untyped-def]
    x = h(write_behind_bytes=1)  # any entry behind is over the bound
    staged = [x.stage(s, 8)[0] for s in SEQS[:3]]

    async def commit_all() -> list[float]:
        behind = []
        for keys in staged:
            assert [r.status for r in await x.store.commit(x.ns.id, keys)] == ["ok", "ok"]
            behind.append(x.store.behind.entries)
        return behind

    assert x.run(commit_all()) == [2, 2, 2]  # each commit waited for the one before it to be written
    assert value(x.store, "prefixstore_write_behind_waits_total") == 2
    x.drain()
    assert disk_entries(x) == 6


def test_close_drains_and_sync_writes_through(h, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    x = h()
    x.save(SEQS[0], 8)
    x.restart()  # close drains the queue
    assert len(x.store.index.entries) == 2
    s = CoreHarness(StoreConfig(port=0, data_dir=str(tmp_path / "sync"), ram_bytes=64 * 256, page_bytes=256,
                                durability="sync"), make_namespace(block_tokens=4))
    try:
        s.save(SEQS[1], 8)
        assert disk_entries(s) == 2 and value(s.store, "prefixstore_write_behind_entries") == 0  # at commit
    finally:
        s.close()
