"""Damage on disk: a flipped byte in a record is a miss, never an entry answering for other tokens;
a damaged LMDB file is dropped or set aside, never a 500 and never a node that will not start."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path

import lmdb
import msgpack

from prefixstore.client.prompt import Prompt
from prefixstore.protocol import Namespace
from prefixstore.store import StoreConfig
from prefixstore.store.index import scope
from prefixstore.store.lmdb_tier import FORMAT_VERSION, db_key, seal, unseal

from ..conftest import RunningStore
from ..factories import kv_payload, make_namespace, state_payload
from ..samples import sample

StartStore = Callable[[StoreConfig], Awaitable[RunningStore]]
NS = make_namespace()
TOKENS = list(range(100, 100 + 4 * NS.block_tokens + 3))  # 4 blocks, a 3-token tail
BIG = make_namespace(block_tokens=64, model="big-blocks")  # 4 KiB payloads: LMDB overflow pages
BIG_TOKENS = list(range(7, 7 + 4 * 64))


def config(tmp_path: Path, **knobs: object) -> StoreConfig:
    values: dict[str, object] = dict(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 << 20, page_bytes=4096,
                                     disk_bytes=64 << 20, nixl="off")
    values.update(knobs)
    return StoreConfig(**values)  # type: ignore[arg-type]


async def save(running: RunningStore, ns: Namespace, tokens: list[int], snapshots: tuple[int, ...] = ()) -> None:
    async with running.client(ns) as c:
        res = await c.save(c.prompt(tokens), len(tokens), lambda s, e: kv_payload(ns, tokens, s, e),
                           snapshots={n: state_payload(ns, tokens, n) for n in snapshots})
        assert res.dropped == 0 and res.rejected == 0, res


async def lookup(running: RunningStore, ns: Namespace, tokens: list[int]) -> tuple[int, int]:
    async with running.client(ns) as c:
        res = await c.lookup(tokens, lease=False)
        assert c.failures == {}, c.failures
        return res.kv_tokens, res.state_tokens


def server_errors(running: RunningStore) -> float:
    return sum(sample(running.store, "prefixstore_requests_total", endpoint=e, status="5xx")
               for e in ("/v1/lookup", "/v1/get", "/v1/put", "/v1/offer", "/v1/commit"))


async def restart(start_store: StartStore, running: RunningStore, cfg: StoreConfig) -> RunningStore:
    await running.server.close()
    return await start_store(cfg)


def edit_record(data_dir: Path, key: bytes, change: Callable[[list[object]], None], reseal: bool) -> None:
    """Change block ``key``'s record in place (with the store stopped)."""
    env = lmdb.open(str(data_dir), max_dbs=4, subdir=True)
    try:
        entries = env.open_db(b"entries")
        with env.begin(write=True, db=entries) as txn:
            sealed = txn.get(db_key(key))
            assert sealed is not None
            fields = msgpack.unpackb(unseal(sealed), raw=False)
            change(fields)
            raw = msgpack.packb(fields, use_bin_type=True)
            txn.put(db_key(key), seal(raw) if reseal else raw + sealed[-8:])
    finally:
        env.close()


def flip_token(fields: list[object]) -> None:
    tokens = bytearray(fields[4])  # type: ignore[arg-type]
    tokens[0] ^= 0x01  # the first token of the block, one bit
    fields[4] = bytes(tokens)


async def check_flipped_record_is_dropped(start_store: StartStore, tmp_path: Path, reseal: bool) -> None:
    cfg = config(tmp_path)
    running = await start_store(cfg)
    await save(running, NS, TOKENS, snapshots=(8, len(TOKENS)))
    assert await lookup(running, NS, TOKENS) == (len(TOKENS), len(TOKENS))
    await running.server.close()
    block3 = scope(NS.id, Prompt(NS, TOKENS).block_key(2))  # tokens 8..12
    edit_record(tmp_path / "lmdb", block3, flip_token, reseal)
    running = await start_store(cfg)
    never = list(TOKENS)
    never[8] ^= 0x01  # the prompt the flipped record now claims to hold: never stored
    # Block 3 is gone with what depends on it (block 4, the tail, the snapshot at the end);
    # blocks 1-2 and the snapshot at 8 are intact. Before: never-stored answered kv=state=12.
    assert await lookup(running, NS, never) == (8, 8)
    assert await lookup(running, NS, TOKENS) == (8, 8)
    running.store.check()


async def test_a_flipped_record_byte_fails_its_seal(start_store: StartStore, tmp_path: Path) -> None:
    await check_flipped_record_is_dropped(start_store, tmp_path, reseal=False)


async def test_a_flipped_record_that_still_verifies_is_re_derived_and_dropped(start_store: StartStore,
                                                                             tmp_path: Path) -> None:
    """The seal recomputed (a bug, or someone with the disk): the key no longer follows from the
    record's tokens, so it is dropped all the same."""
    await check_flipped_record_is_dropped(start_store, tmp_path, reseal=True)


async def test_a_record_of_another_namespace_key_is_dropped(start_store: StartStore, tmp_path: Path) -> None:
    """A record whose namespace field was changed (sealed again) names a key of another
    namespace: re-derivation refuses it rather than attach it anywhere."""
    cfg = config(tmp_path)
    running = await start_store(cfg)
    other = make_namespace(tenant="other")
    await save(running, other, [1, 2, 3, 4])
    await save(running, NS, TOKENS)
    await running.server.close()
    key = scope(NS.id, Prompt(NS, TOKENS).block_key(0))

    def move(fields: list[object]) -> None:
        fields[1] = other.id

    edit_record(tmp_path / "lmdb", key, move, reseal=True)
    running = await start_store(cfg)
    assert await lookup(running, NS, TOKENS) == (0, 0)
    assert await lookup(running, other, [1, 2, 3, 4]) == (4, 0)
    running.store.check()


def damage_payload_page(data_dir: Path, payload: bytes) -> None:
    """Overwrite the LMDB page header in front of ``payload`` (an overflow page), in the live file."""
    path = data_dir / "data.mdb"
    data = path.read_bytes()
    at = data.find(payload[:256])
    assert at >= 16 and data.find(payload[:256], at + 1) == -1
    with open(path, "r+b") as f:
        f.seek(at - 16)
        f.write(b"\xa5" * 16)


async def test_a_damaged_payload_page_is_a_miss_then_the_tier_resets(start_store: StartStore, tmp_path: Path,
                                                                     caplog) -> None:  # type: ignore[no-untyped-def]
    """Every /v1/get of an entry on a damaged page was a 500 (MDB_BAD_TXN). Now: a miss; the
    delete that follows meets the damage too, so the tier is set aside and the node serves on."""
    cfg = config(tmp_path)
    running = await start_store(cfg)
    await save(running, BIG, BIG_TOKENS)
    running = await restart(start_store, running, cfg)  # RAM is empty now: every read comes from LMDB
    assert await lookup(running, BIG, BIG_TOKENS) == (len(BIG_TOKENS), 0)
    damage_payload_page(tmp_path / "lmdb", kv_payload(BIG, BIG_TOKENS, 128, 192))  # block 3
    caplog.set_level(logging.WARNING)
    async with running.client(BIG) as c:
        res = await c.lookup(BIG_TOKENS)
        reads = res.kv_reads(res.kv_tokens)
        outs = [bytearray(BIG.block_bytes) for _ in reads]
        got = await c.read([item for item, _, _ in reads], outs)
        await c.release(res.lease_id)
        assert got[2] == -1  # block 3: a miss, never wrong bytes
        for (_, a, b), out, n in zip(reads, outs, got):
            assert n < 0 or bytes(out[:n]) == kv_payload(BIG, BIG_TOKENS, a, b)
    assert server_errors(running) == 0
    assert sample(running.store, "prefixstore_lmdb_resets_total") == 1
    assert any("LMDB tier reset" in r.getMessage() for r in caplog.records)
    # It serves on: saves are taken and persisted in the new environment.
    await save(running, NS, TOKENS)
    running = await restart(start_store, running, cfg)
    assert await lookup(running, NS, TOKENS) == (len(TOKENS), 0)
    running.store.check()


async def test_a_file_lmdb_cannot_open_is_set_aside_and_the_node_starts_empty(
        start_store: StartStore, tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    """≥100 damaged bytes and the node exited 1 until someone deleted the directory."""
    cfg = config(tmp_path, keep_damaged_lmdb=True)
    running = await start_store(cfg)
    await save(running, NS, TOKENS)
    await running.server.close()
    with open(tmp_path / "lmdb" / "data.mdb", "r+b") as f:
        f.write(b"\x5a" * 8192)  # both meta pages
    caplog.set_level(logging.ERROR)
    running = await start_store(cfg)
    assert sample(running.store, "prefixstore_lmdb_resets_total") == 1
    assert any("could not be used" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "lmdb" / "quarantine" / "data.mdb").exists()  # kept for inspection, as asked
    assert await lookup(running, NS, TOKENS) == (0, 0)
    await save(running, NS, TOKENS)
    assert await lookup(running, NS, TOKENS) == (len(TOKENS), 0)
    running.store.check()


async def test_an_environment_of_another_format_is_set_aside(start_store: StartStore, tmp_path: Path) -> None:
    cfg = config(tmp_path)
    running = await start_store(cfg)
    await save(running, NS, TOKENS)
    await running.server.close()
    env = lmdb.open(str(tmp_path / "lmdb"), max_dbs=4, subdir=True)
    with env.begin(write=True, db=env.open_db(b"meta")) as txn:
        txn.put(b"format", str(FORMAT_VERSION - 1).encode())
    env.close()
    running = await start_store(cfg)
    assert sample(running.store, "prefixstore_lmdb_resets_total") == 1
    assert not (tmp_path / "lmdb" / "quarantine").exists()  # keep_damaged_lmdb off: deleted
    assert await lookup(running, NS, TOKENS) == (0, 0)
    running.store.check()
