"""NIXL READs straight out of LMDB's memory map (LMDB-resident entries, no promotion into RAM).

Real stores, real agents: a `prefixstore serve` process for the plain path (restarted, so every
entry is LMDB-resident; one LMDB value corrupted on disk while it is down), and stores in this
process (a clock the test moves, the tier at hand) for the map growing under a lease, expiry,
and the cap on pinned read transactions."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import lmdb
import numpy as np
import pytest
import xxhash
from aiohttp.test_utils import TestServer
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.nixl_path import TransferFailed, address_of, descriptor_lists
from prefixstore.store import STORE, Store, StoreConfig, create_app
from prefixstore.store.index import scope
from prefixstore.store.lmdb_tier import LmdbTier, StoredRecord, db_key
from prefixstore.store.nixl_target import NIXL, NixlTarget

from ..serve_process import StartServe, clean_env, serving
from .conftest import NEEDS_NIXL, Clock
from .helpers import (
    block_reads,
    interleave_after,
    metric,
    namespace,
    read,
    save,
    tokens,
)

pytestmark = NEEDS_NIXL

MiB = 1 << 20


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@asynccontextmanager
async def in_process(data_dir: Path, clock: Clock | None = None, **knobs: object
                     ) -> AsyncIterator[tuple[str, Store, NixlTarget]]:
    """A store in this process over ``data_dir`` serving NIXL; closed on exit, so another one
    opened on the same directory afterwards finds every entry on disk only."""
    values: dict[str, object] = {"port": 0, "data_dir": str(data_dir), "ram_bytes": 256 << 10, "page_bytes": 4096,
                                 "disk_bytes": 4 * MiB, "lease_ttl_s": 30.0, "nixl": "on"}
    values.update(knobs)
    server = TestServer(create_app(StoreConfig(**values), clock or Clock()), host="127.0.0.1")
    await server.start_server()
    try:
        target = server.app[NIXL].target
        assert target is not None
        if not target.map_reads and values.get("nixl_map_txns", 1) and _cuda_in_this_process():
            # Seen on an H200: in a process that has initialised CUDA, UCX's cuda_copy domain pins every
            # registration and refuses LMDB's read-only file map, so the store promotes instead (a
            # `prefixstore serve` process there READs from the map: the first test above).
            pytest.skip("UCX cannot register LMDB's map in a process using CUDA (see docs/nixl.md)")
        yield str(server.make_url("")).rstrip("/"), server.app[STORE], target
    finally:
        await server.close()


def _cuda_in_this_process() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


async def saved_on_disk(data_dir: Path, toks: list[int]) -> None:
    """Save the chain of ``toks`` through one store, then close it: the next store opened on
    ``data_dir`` holds it in LMDB only."""
    async with in_process(data_dir) as (url, _, _), PrefixClient(namespace(), ClientConfig(url=url)) as client:
        assert await save(client, toks) == len(toks) // 64


def sample(store: Store, name: str, **labels: str) -> float:
    """A metric of a store in this process (its /metrics cannot be fetched synchronously here)."""
    value = store.metrics.registry.get_sample_value(name, labels)
    assert value is not None, f"{name}{labels} not in the registry"
    return value


def used_bytes(store: Store) -> int:
    return store.arena.capacity_bytes - store.arena.num_free * store.arena.page_bytes


async def test_lmdb_resident_entries_are_read_from_the_map_and_corrupt_ones_never(serve: StartServe,
                                                                                  tmp_path: Path) -> None:
    """A store process restarted over its LMDB: whole blocks and a layer range READ out of the
    map are what was put, the arena holds none of them, and every read transaction ends with its
    lease. A value corrupted on disk while the store was down is answered "corrupt" (no
    descriptors) and never lands in the client's buffer; the others of the batch still arrive."""
    data = str(tmp_path / "lmdb")
    args = ["--port", "0", "--data-dir", data, "--ram-bytes", "1MiB", "--page-bytes", "4KiB", "--nixl", "on"]
    ns = namespace()
    toks = tokens(31, 6)
    first = serve(*args)
    assert first.url is not None
    async with PrefixClient(ns, ClientConfig(url=first.url)) as client:
        assert await save(client, toks) == 6
        items, expected = block_reads(client, toks)
    assert first.stop() == 0

    proc = serve(*args)
    url = proc.url
    assert url is not None
    capacity = metric(url, "prefixstore_arena_capacity_bytes", "")
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        for layer in (None, 1):
            items_l, expected_l = block_reads(client, toks, layer)
            got, outs = await read(client, items_l, len(expected_l[0]))
            assert got == [len(expected_l[0])] * 6
            assert [o.tobytes() for o in outs] == expected_l
        assert client.path_bytes["http"] == 0 and client.failures == {}
    assert metric(url, "prefixstore_nixl_disk_reads_total", 'how="map"') == 12
    assert metric(url, "prefixstore_nixl_disk_reads_total", 'how="promoted"') == 0
    assert metric(url, "prefixstore_arena_free_bytes", "") == capacity  # nothing was promoted
    assert metric(url, "prefixstore_lmdb_read_txns", "") == 0  # ended on release
    assert metric(url, "prefixstore_leases", "") == 0
    assert proc.stop() == 0

    # Corrupt block 2's value on disk (same length, one byte flipped), then serve it again.
    key = db_key(scope(client.namespace.id, items[2].key))  # the tier's key: version byte + scoped key
    env = lmdb.open(data, max_dbs=4, subdir=True)
    payloads = env.open_db(b"payloads")
    with env.begin(write=True, db=payloads) as txn:
        stored = txn.get(key)
        assert stored is not None
        value = bytearray(stored)
        value[100] ^= 0xFF
        txn.put(key, bytes(value))
    env.close()
    again = serve(*args)
    url = again.url
    assert url is not None
    answers: list[dict[str, object]] = []

    async def keep(path: str, answer: dict[str, object]) -> None:
        answers.append(answer)

    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        interleave_after(client, "/v1/nixl/get", keep)
        got, outs = await read(client, items[:4], ns.block_bytes, fill=0x5A)
    wire = answers[0]["items"]
    assert isinstance(wire, list) and wire[2][0] == "corrupt" and wire[2][3] == b""
    # Block 3 was verified in the same read transaction before block 2 was found corrupt: its
    # bytes are right and are served, although it is deleted with block 2 (its parent).
    assert got == [ns.block_bytes, ns.block_bytes, -1, ns.block_bytes]
    assert [outs[i].tobytes() for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
    assert outs[2].tobytes() == bytes([0x5A]) * ns.block_bytes  # untouched: nothing was READ into it
    assert metric(url, "prefixstore_checksum_failures_total", 'tier="disk"') == 1
    assert metric(url, "prefixstore_lmdb_read_txns", "") == 0
    assert again.stop() == 0


@pytest.mark.parametrize("verify", [True, False])
async def test_map_growth_under_a_lease_ends_it_cleanly(tmp_path: Path, verify: bool) -> None:
    """Between the descriptors and the READ, a write outgrows LMDB's map, which moves. The lease
    holding the read transaction is ended first (the transaction with it), the new map is
    registered under a new metadata generation, and the READ yields the right bytes or a clean
    miss (zeroed), never other bytes; the next read is served from the new map."""
    data = tmp_path / "lmdb"
    toks, later = tokens(41, 4), tokens(42, 2)
    await saved_on_disk(data, toks)
    await saved_on_disk(data, later)
    async with in_process(data) as (url, store, target), \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl", verify_checksums=verify)) as client:
        tier = store.tier
        assert tier is not None and tier.region is not None
        items, expected = block_reads(client, toks)
        seen: list[object] = []

        async def outgrow_the_map(path: str, answer: dict[str, object]) -> None:
            assert tier.pinned == 1 and answer["meta_gen"] == 0
            before = tier.region
            filler = os.urandom(MiB)
            records = [StoredRecord(key=bytes([9]) + i.to_bytes(16, "big"), namespace_id=bytes(8), parent=None,
                                    start=0, tokens=b"", extra=b"", container=None, boundary=0, size=8 * MiB,
                                    checksum=0) for i in range(9)]  # 72 MiB: past the 64 MiB map
            await tier.write([(r, [memoryview(filler * 8)]) for r in records], ())
            seen.extend([before, tier.region, tier.pinned, len(store.leases), target.meta_gen])

        stop = interleave_after(client, "/v1/nixl/get", outgrow_the_map)
        got, outs = await read(client, items, client.namespace.block_bytes)
        before, after, pinned, leases, gen = seen
        assert after != before and pinned == 0 and leases == 0 and gen == 1
        for n, out, want in zip(got, outs, expected):
            assert (n == len(want) and out.tobytes() == want) or (n == -1 and not out.any())
        assert sample(store, "prefixstore_nixl_map_revoked_total") == 1
        stop()  # no more interleaving
        got, outs = await read(client, items, client.namespace.block_bytes)  # from RAM or the new map
        assert got == [len(w) for w in expected] and [o.tobytes() for o in outs] == expected
        mapped = sample(store, "prefixstore_nixl_disk_reads_total", how="map")
        items2, expected2 = block_reads(client, later)  # never read yet: in LMDB only
        got, outs = await read(client, items2, client.namespace.block_bytes)
        assert got == [len(w) for w in expected2] and [o.tobytes() for o in outs] == expected2
        assert sample(store, "prefixstore_nixl_disk_reads_total", how="map") == mapped + 2  # from the new map
        assert client.path_bytes["nixl"] > 0 and tier.pinned == 0
        # The map moves again with no lease out: a client that sees the new generation in an
        # answer reloads the metadata (the old one does not describe the new map).
        channel = client.impl.data.channel
        assert channel is not None
        await channel.follow(target.name, 1)
        assert channel.path.knows(target.name, 1) and channel.path.remote_gen == 1
        await tier.write([(StoredRecord(key=bytes([9]) + bytes(16), namespace_id=bytes(8), parent=None, start=0,
                                        tokens=b"", extra=b"", container=None, boundary=0, size=32 * MiB, checksum=0),
                           [memoryview(bytes(32 * MiB))])], ())
        assert target.meta_gen == 2 and not channel.path.knows(target.name, 2)
        await channel.follow(target.name, 2)
        assert channel.path.knows(target.name, 2) and channel.path.remote_gen == 2
        store.check()


async def test_read_txns_end_on_release_and_on_expiry(tmp_path: Path) -> None:
    """A lease's read transaction ends when the lease is released, and when it expires with
    nobody calling into the store (the NIXL progress task expires leases that hold one)."""
    await read_txns_end_on_release_and_on_expiry(tmp_path)


async def test_read_txns_end_on_expiry_with_the_progress_task_idle(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The same with the lease no longer keeping the progress task busy (past BUSY_WINDOW_S): its
    slow idle polls still expire the lease and end the transaction."""
    monkeypatch.setattr("prefixstore.store.nixl_target.BUSY_WINDOW_S", 0.0)
    await read_txns_end_on_release_and_on_expiry(tmp_path)


async def read_txns_end_on_release_and_on_expiry(tmp_path: Path) -> None:
    data = tmp_path / "lmdb"
    toks = tokens(51, 3)
    await saved_on_disk(data, toks)
    clock = Clock()
    async with in_process(data, clock, lease_ttl_s=2.0) as (url, store, _), \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl")) as client:
        tier = store.tier
        assert tier is not None
        items, expected = block_reads(client, toks)
        ended_by_expiry: list[int] = []

        async def expire(path: str, answer: dict[str, object]) -> None:
            assert tier.pinned == 1
            clock.now += 5.0  # past lease_ttl_s; nothing calls sweep or lookup
            for _ in range(500):
                if tier.pinned == 0:
                    break
                await asyncio.sleep(0.01)
            ended_by_expiry.append(tier.pinned)

        got, outs = await read(client, items, client.namespace.block_bytes)  # released by the client
        assert got == [len(w) for w in expected] and [o.tobytes() for o in outs] == expected
        assert tier.pinned == 0 and sample(store, "prefixstore_lmdb_read_txns") == 0
        interleave_after(client, "/v1/nixl/get", expire)
        got, outs = await read(client, items, client.namespace.block_bytes)
        assert ended_by_expiry == [0] and len(store.leases) == 0
        for n, out, want in zip(got, outs, expected):  # the map did not move: right bytes or a clean miss
            assert (n == len(want) and out.tobytes() == want) or (n == -1 and not out.any())
        assert sample(store, "prefixstore_lmdb_read_txns") == 0
        store.check()


async def test_the_cap_on_read_txns_falls_back_to_promotion(tmp_path: Path) -> None:
    """With nixl_map_txns = 1 and one lease holding the only read transaction, another read of
    LMDB-resident entries is promoted into RAM (counted) and still delivers the bytes."""
    data = tmp_path / "lmdb"
    toks, other = tokens(61, 3), tokens(62, 3)
    await saved_on_disk(data, toks)
    await saved_on_disk(data, other)
    async with in_process(data, nixl_map_txns=1) as (url, store, _), \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl")) as first, \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl")) as second:
        tier = store.tier
        assert tier is not None
        items, expected = block_reads(first, toks)
        items2, expected2 = block_reads(second, other)
        during: list[object] = []

        async def read_another(path: str, answer: dict[str, object]) -> None:
            assert tier.pinned == 1
            before = used_bytes(store)
            got2, outs2 = await read(second, items2, second.namespace.block_bytes)
            during.extend([got2, [o.tobytes() for o in outs2], used_bytes(store) - before])

        interleave_after(first, "/v1/nixl/get", read_another)
        got, outs = await read(first, items, first.namespace.block_bytes)
        assert got == [len(w) for w in expected] and [o.tobytes() for o in outs] == expected
        got2, bytes2, grew = during
        assert got2 == [len(w) for w in expected2] and bytes2 == expected2
        assert grew == 3 * second.namespace.block_bytes  # promoted: the arena holds them now
        assert sample(store, "prefixstore_nixl_disk_reads_total", how="map") == 3
        assert sample(store, "prefixstore_nixl_disk_reads_total", how="promoted") == 3
        assert tier.pinned == 0
        store.check()



async def test_a_write_into_the_map_fails_and_changes_nothing(tmp_path: Path) -> None:
    """LMDB maps its file read-only: a client that WRITEs to map descriptors it was given (to
    scribble on the database file) fails, and the stored bytes stay what was put."""
    data = tmp_path / "lmdb"
    toks = tokens(71, 2)
    await saved_on_disk(data, toks)
    async with in_process(data) as (url, store, _), \
            PrefixClient(namespace(), ClientConfig(url=url, data_path="nixl")) as client:
        items, expected = block_reads(client, toks)
        junk = np.full(len(expected[0]), 0xEE, dtype=np.uint8)
        where = address_of(junk.data)
        failures: list[str] = []

        async def scribble(path: str, answer: dict[str, object]) -> None:
            channel = client.impl.data.channel
            assert channel is not None
            await channel.follow(answer["agent"], answer["meta_gen"])
            raw = answer["items"]
            assert isinstance(raw, list) and raw[0][0] == "ok"
            local, remote = descriptor_lists([raw[0][3]], [junk.nbytes], [where])
            try:
                await channel.path.transfer("WRITE", local, remote, [(where, junk.nbytes)], 5.0)
            except TransferFailed as err:
                failures.append(str(err))

        stop = interleave_after(client, "/v1/nixl/get", scribble)
        got, outs = await read(client, items, len(expected[0]))
        assert failures, "a WRITE into LMDB's map went through"
        assert got == [len(w) for w in expected] and [o.tobytes() for o in outs] == expected
        stop()
        got, outs = await read(client, items, len(expected[0]))
        assert [o.tobytes() for o in outs] == expected
        store.check()

async def test_growth_waits_for_reads_and_ends_pins(tmp_path: Path) -> None:
    """The tier alone: while reads copy values out on the reader pool and a pin holds a read
    transaction, a write outgrows the map. The pin is ended (revoked) before the map moves,
    every read completes with the right bytes, and afterwards pins work in the new map."""
    tier = LmdbTier(tmp_path / "lmdb", disk_bytes=1 * MiB, max_pins=2)
    try:
        values = [os.urandom(MiB) for _ in range(4)]
        records = [StoredRecord(key=bytes([1]) + i.to_bytes(16, "big"), namespace_id=bytes(8), parent=None, start=0,
                                tokens=b"", extra=b"", container=None, boundary=0, size=MiB,
                                checksum=xxhash.xxh3_64_intdigest(v)) for i, v in enumerate(values)]
        await tier.write([(r, [memoryview(v)]) for r, v in zip(records, values)], ())
        wanted = [(r.key, r.size, r.checksum, 0, r.size) for r in records]
        pin, found = await tier.pin(wanted)
        assert pin is not None and [f.outcome for f in found] == ["ok"] * 4 and tier.pinned == 1
        before = tier.region
        outs = [bytearray(MiB) for _ in range(24)]
        filler = bytes(72 * MiB)  # past the 64 MiB map in one transaction
        big = StoredRecord(key=bytes([9]) + bytes(16), namespace_id=bytes(8), parent=None, start=0, tokens=b"",
                           extra=b"", container=None, boundary=0, size=len(filler), checksum=0)
        results = await asyncio.gather(
            *(tier.read_into(records[i % 4].key, MiB, records[i % 4].checksum, [memoryview(o)])
              for i, o in enumerate(outs[:12])),
            tier.write([(big, [memoryview(filler)])], ()),
            *(tier.read_into(records[i % 4].key, MiB, records[i % 4].checksum, [memoryview(o)])
              for i, o in enumerate(outs[12:])))
        assert [r for r in results if r is not None] == ["ok"] * 24
        assert all(bytes(o) == values[i % 4] for i, o in enumerate(outs))
        assert pin.ended and pin.revoked and tier.pinned == 0 and tier.map_gen == 1 and tier.region != before
        again, found = await tier.pin(wanted)
        assert again is not None and tier.region is not None
        lo, size = tier.region
        assert all(f.outcome == "ok" and lo <= f.address < lo + size for f in found)
        again.end()
        assert tier.pinned == 0
    finally:
        tier.close()

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "nixl_lmdb_read.py"


@pytest.mark.slow
def test_benchmark_quick_run_writes_json_and_png(tmp_path: Path) -> None:
    """benchmarks/nixl_lmdb_read.py end to end with --quick (figures meaningless): it checks on
    its own that every timed GET read what it claims (map vs promoted, by the stores' counters)."""
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(BENCH), "--quick", "--reps", "1", "--warmup", "0", "--payload-sizes",
                           "64KiB", "--batch-bytes", "1MiB", "--out", str(out)], capture_output=True, text=True,
                          timeout=300, check=False, cwd=BENCH.parents[1], env=clean_env())
    assert proc.returncode == 0, f"exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    results = json.loads((out / "nixl_lmdb_read.json").read_text())
    assert results["benchmark"] == "nixl_lmdb_read" and len(results["results"]) == 1
    assert set(results["results"][0]["figures"]) == {"map", "promote", "ram"}
    assert (out / "nixl_lmdb_read.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    helped = subprocess.run([sys.executable, str(BENCH), "--help"], capture_output=True, text=True, timeout=60,
                            cwd=BENCH.parents[1], check=True)
    for flag in ("--payload-sizes", "--batch-bytes", "--sets", "--out", "--quick", "--reps", "--warmup", "--seed"):
        assert flag in helped.stdout
