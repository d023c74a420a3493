"""Durability across process death, with a real ``prefixstore serve`` subprocess.

DESIGN §7: a restarted node serves what it had committed (``durability=sync``
writes through to LMDB at commit, so even SIGKILL loses nothing; write-behind's
bounds are tested in tests/durability). DESIGN §4: a payload whose
checksum fails on the way out of a tier is a miss plus a deletion, never
wrong bytes.
"""

from __future__ import annotations

import json
import re
import signal
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import lmdb
import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem
from prefixstore.store.index import scope
from prefixstore.store.lmdb_tier import db_key

from ..factories import kv_payload, make_namespace, state_payload
from ..serve_process import ServeProcess, StartServe, http_get, serving


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start

BASE = 100


@dataclass(frozen=True)
class Saved:
    tokens: list[int]
    kv_upto: int
    snapshots: tuple[int, ...]


# Several conversations sharing prefixes: blocks, tails, a multi-turn extension
# whose next block covers a stored tail, a branch, and snapshots at block
# boundaries and mid-block. Block size 4.
A = list(range(BASE, BASE + 11))
SAVED = [
    Saved(A, 11, (4, 11)),
    Saved(A + [7, 8, 9, 10, 11, 12, 13, 14], 19, (19,)),  # the next turn: prompt + answer
    Saved(list(range(300, 316)), 16, (10, 16)),
    Saved(A[:8] + list(range(900, 906)), 13, (13,)),  # a branch off block 1
]


def _args(data_dir: Path) -> list[str]:
    return ["--port", "0", "--data-dir", str(data_dir), "--ram-bytes", "1MiB", "--page-bytes", "4KiB",
            "--disk-bytes", "64MiB", "--durability", "sync"]


def _client(p: ServeProcess, ns: Namespace, verify_checksums: bool = True) -> PrefixClient:
    assert p.url is not None
    return PrefixClient(ns, ClientConfig(url=p.url, timeout_s=5.0, verify_checksums=verify_checksums))


async def _save_all(c: PrefixClient) -> None:
    ns = c.namespace
    for s in SAVED:
        toks = s.tokens
        r = await c.save(c.prompt(toks), s.kv_upto, lambda a, b, toks=toks: kv_payload(ns, toks, a, b),
                         {t: state_payload(ns, toks, t) for t in s.snapshots})
        assert (r.rejected, r.dropped) == (0, 0), r
        assert r.stored > 0


@dataclass(frozen=True)
class Found:
    kv_tokens: int
    state_tokens: int
    kv: bytes  # the prompt's KV [0, kv_tokens) gathered from the reads, layer-major per read
    state: bytes | None


async def _find(c: PrefixClient, tokens: Sequence[int]) -> Found:
    """Look a prompt up and read everything it reuses, checking the bytes against the factories."""
    ns = c.namespace
    res = await c.lookup(list(tokens))
    assert res.ok
    reads = res.kv_reads(res.kv_tokens)
    outs = [bytearray(ns.block_tokens * ns.kv.token_bytes) for _ in reads]
    got = await c.read([item for item, _, _ in reads], outs)
    assert all(n > 0 for n in got), got
    per_layer = ns.kv.layer_token_bytes
    kv = bytearray()
    for (_, a, b), out, n in zip(reads, outs, got):
        # The last read may be a stored child (which child is the store's
        # choice) of which only the first b - a tokens are this prompt's:
        # keep those, layer by layer (the payload is layer-major).
        stored_tokens = n // ns.kv.token_bytes
        usable = b"".join(bytes(out[layer * stored_tokens * per_layer:][: (b - a) * per_layer])
                          for layer in range(ns.kv.num_layers))
        assert usable == kv_payload(ns, list(tokens), a, b)
        kv += usable
    state = None
    item = res.state_read()
    if item is not None:
        out = bytearray(ns.state.snapshot_bytes)
        assert await c.read([item], [out]) == [len(out)]
        state = bytes(out)
        assert state == state_payload(ns, list(tokens), res.state_tokens)
    await c.release(res.lease_id)
    return Found(res.kv_tokens, res.state_tokens, bytes(kv), state)


def _entries(c: PrefixClient, s: Saved) -> list[tuple[GetItem, bytes]]:
    """Every entry a save of ``s`` committed, with the exact payload it was given."""
    ns = c.namespace
    p = c.prompt(s.tokens)
    out = [(GetItem(key=make_entry_key(spec.kind, spec.hash)), kv_payload(ns, s.tokens, a, b))
           for spec, a, b in p.kv_items(s.kv_upto)]
    for t in s.snapshots:
        spec = p.state_item(t, s.kv_upto)
        out.append((GetItem(key=make_entry_key(Kind.STATE, spec.hash)), state_payload(ns, s.tokens, t)))
    return out


async def _read_exact(c: PrefixClient, entries: list[tuple[GetItem, bytes]]) -> None:
    outs = [bytearray(len(want)) for _, want in entries]
    assert await c.read([item for item, _ in entries], outs) == [len(want) for _, want in entries]
    for out, (_, want) in zip(outs, entries):
        assert out == want


def _disk_entries(url: str) -> dict[str, int]:
    status, body = http_get(url + "/v1/stats")
    assert status == 200
    entries = json.loads(body)["entries"]
    return {k: v for k, v in entries.items() if k.endswith("/disk")}


def _checksum_failures(url: str, tier: str) -> float:
    status, body = http_get(url + "/metrics")
    assert status == 200
    m = re.search(rf'^prefixstore_checksum_failures_total{{tier="{tier}"}} (\S+)$', body.decode(), re.M)
    return float(m.group(1)) if m else 0.0


async def test_sigkill_loses_no_committed_entry(tmp_path: Path, serve: StartServe) -> None:
    ns = make_namespace()
    data_dir = tmp_path / "lmdb"
    first = serve(*_args(data_dir))
    c = _client(first, ns)
    try:
        await _save_all(c)
        before = {i: await _find(c, s.tokens) for i, s in enumerate(SAVED)}
        entries = list({item.key: (item, want) for s in SAVED for item, want in _entries(c, s)}.values())
        await _read_exact(c, entries)
    finally:
        await c.close()
    for i, s in enumerate(SAVED):  # the specification (DESIGN §5), before any restart
        assert before[i].kv_tokens == s.kv_upto
        assert before[i].state_tokens == max(s.snapshots)
    disk_before = _disk_entries(first.url or "")
    assert sum(disk_before.values()) > 0

    first.kill()  # SIGKILL: no shutdown, no LMDB close
    assert first.proc.returncode == -signal.SIGKILL

    second = serve(*_args(data_dir))
    assert _disk_entries(second.url or "") == disk_before
    c = _client(second, ns)
    try:
        await _read_exact(c, entries)  # every committed entry, byte-identical, read back from disk
        for i, s in enumerate(SAVED):
            assert await _find(c, s.tokens) == before[i], f"conversation {i} changed across the restart"
        # Extensions of stored prompts still match to the exact token.
        ext = await _find(c, SAVED[1].tokens + [1, 2, 3])
        assert (ext.kv_tokens, ext.state_tokens) == (19, 19)
        assert c.failures == {}
    finally:
        await c.close()
    assert second.stop() == 0


async def test_corrupt_disk_payload_is_a_miss_and_deleted(tmp_path: Path, serve: StartServe) -> None:
    ns = make_namespace()
    data_dir = tmp_path / "lmdb"
    first = serve(*_args(data_dir))
    c = _client(first, ns)
    try:
        await _save_all(c)
    finally:
        await c.close()
    assert first.stop() == 0  # SIGTERM: LMDB closed cleanly before we open it

    # Flip bytes of block 1 of conversation A (tokens 4..8), keeping its length.
    prompt = c.prompt(A)
    victim = prompt.block_key(1)
    tail = prompt.kv_key_ending_at(11)
    dbkey = db_key(scope(ns.id, victim))  # format version byte + namespace-scoped key (store/lmdb_tier.py)
    env = lmdb.open(str(data_dir), max_dbs=4, subdir=True)
    try:
        payloads = env.open_db(b"payloads")
        with env.begin(write=True, db=payloads) as txn:
            good = txn.get(dbkey)
            assert good is not None and len(good) == 4 * ns.kv.token_bytes
            bad = bytes(b ^ 0xFF for b in good[:8]) + good[8:]
            txn.put(dbkey, bad)
    finally:
        env.close()

    second = serve(*_args(data_dir))
    url = second.url or ""
    assert _checksum_failures(url, "disk") == 0
    # The client's own checksum check is off: the server alone must refuse the bytes.
    c = _client(second, ns, verify_checksums=False)
    try:
        out = bytearray(len(good))
        assert await c.read([GetItem(key=victim)], [out]) == [-1]
        assert out == bytearray(len(out))  # a miss writes nothing: never the corrupted bytes
        assert _checksum_failures(url, "disk") == 1

        # Gone, with everything that depended on it (the tail after it, the
        # snapshot at 11); what lies before it is intact.
        res = await c.lookup(A, lease=False)
        assert (res.kv_tokens, res.state_tokens) == (4, 4)
        assert await c.read([res.kv_reads(4)[0][0]], [bytearray(len(good))]) == [len(good)]
        assert (await _find(c, A)).state == state_payload(ns, A, 4)
        assert await c.read([GetItem(key=tail)], [bytearray(len(good))]) == [-1]
        # The branch C shared block 1 too; A's next turn extended through it.
        for s in (SAVED[1], SAVED[3]):
            r = await c.lookup(s.tokens, lease=False)
            assert (r.kv_tokens, r.state_tokens) == (4, 4)
        # Unrelated entries are untouched and the server keeps serving.
        other = await _find(c, SAVED[2].tokens)  # checks every byte against the factories
        assert (other.kv_tokens, other.state_tokens) == (16, 16)
        assert http_get(url + "/healthz")[0] == 200
        assert _checksum_failures(url, "disk") == 1  # counted once, not on every later lookup
    finally:
        await c.close()
    assert second.stop() == 0

    # The deletion reached the disk: no restart resurrects the corrupt entry.
    env = lmdb.open(str(data_dir), max_dbs=4, subdir=True, readonly=True)
    try:
        with env.begin() as txn:
            for name in (b"payloads", b"entries"):
                db = env.open_db(name, txn=txn, create=False)
                assert txn.get(dbkey, db=db) is None, name
                assert txn.get(db_key(scope(ns.id, tail)), db=db) is None, name
    finally:
        env.close()



async def test_a_per_rank_namespace_of_the_earlier_scheme_is_still_served(tmp_path: Path, serve: StartServe) -> None:
    """docs/design.md, "One layout for every TP size": a per-rank namespace (hash scheme 1) that an
    engine of the earlier release registered keeps working -- registered, saved, found, read, and
    after a restart read back from LMDB -- and shares nothing with the canonical namespace of the
    same model; a head range of it is refused (its payloads hold one rank's heads)."""
    import dataclasses

    legacy = dataclasses.replace(make_namespace(), hash_scheme=1, tp_rank=1, tp_size=2)
    data_dir = tmp_path / "lmdb"
    first = serve(*_args(data_dir))
    c = _client(first, legacy)
    try:
        await _save_all(c)
        before = {i: await _find(c, s.tokens) for i, s in enumerate(SAVED)}
    finally:
        await c.close()
    assert first.stop() == 0
    second = serve(*_args(data_dir))
    c, canonical = _client(second, legacy), _client(second, make_namespace())
    try:
        for i, s in enumerate(SAVED):
            assert await _find(c, s.tokens) == before[i]
            assert (await canonical.lookup(list(s.tokens))).kv_tokens == 0  # another namespace
        key = c.prompt(SAVED[0].tokens).block_key(0)
        assert await c.read([GetItem(key=key, head_start=0, head_end=1)], [bytearray(256)]) == [-1]
        assert c.failures["read"] == 1
    finally:
        await c.close()
        await canonical.close()
    assert second.stop() == 0


async def test_head_ranges_of_entries_read_back_from_disk(tmp_path: Path, serve: StartServe) -> None:
    """After a restart every entry is on disk only: a head range of it is promoted (or read into a
    buffer), hashed over exactly its runs, and equals the slice of what was saved."""
    from ..factories import head_slice, make_headed_namespace, state_head_slice

    ns = make_headed_namespace()
    data_dir = tmp_path / "lmdb"
    first = serve(*_args(data_dir))
    c = _client(first, ns)
    try:
        await _save_all(c)
    finally:
        await c.close()
    assert first.stop() == 0
    second = serve(*_args(data_dir))
    c = _client(second, ns)
    try:
        s = SAVED[0]
        p = c.prompt(s.tokens)
        for heads in ((0, 2), (2, 4), (1, 2)):
            items, want = [], []
            for spec, a, b in p.kv_items(s.kv_upto):
                items.append(GetItem(key=make_entry_key(spec.kind, spec.hash), head_start=heads[0], head_end=heads[1]))
                want.append(head_slice(ns, kv_payload(ns, s.tokens, a, b), b - a, heads))
            for t in s.snapshots:
                spec = p.state_item(t, s.kv_upto)
                items.append(GetItem(key=make_entry_key(Kind.STATE, spec.hash), head_start=heads[0],
                                     head_end=heads[1]))
                want.append(state_head_slice(ns, state_payload(ns, s.tokens, t), heads))
            outs = [bytearray(len(w)) for w in want]
            assert await c.read(items, outs) == [len(w) for w in want]
            assert [bytes(o) for o in outs] == want
        assert c.failures == {}
    finally:
        await c.close()
    assert second.stop() == 0
