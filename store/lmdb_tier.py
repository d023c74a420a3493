"""The LMDB capacity tier: committed entries on local disk, surviving restarts.

Rules (py-lmdb's own advice, kept here because breaking them corrupts or
deadlocks): one writer thread owns every write transaction; reads are short
and run on a small pool; no environment crosses ``fork()``; a ``MapFullError``
grows the map *outside* any transaction and retries; values read with
``buffers=True`` are copied out before their transaction ends.

Three named databases, keys carrying a format version byte::

    meta     b"format"          -> format version
             b"ns:" + ns_id     -> canonical namespace encoding
    entries  v || kind || hash  -> msgpack record (what the index needs)
    payloads v || kind || hash  -> raw payload bytes

Records and payloads are separate so a restart rebuilds the index by scanning
records only, without touching payload pages. Every payload read verifies the
xxh3-64 checksum in its record before a byte is copied out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb
import msgpack
import xxhash

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
_KEY_PREFIX = bytes((FORMAT_VERSION,))
T = TypeVar("T")


def _dbkey(entry_key: bytes) -> bytes:
    return _KEY_PREFIX + entry_key


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """What the index keeps of an entry, as persisted."""

    key: bytes  # 17-byte entry key
    namespace_id: bytes
    parent: bytes | None
    start: int
    tokens: bytes
    extra: bytes
    container: bytes | None
    boundary: int
    size: int
    checksum: int
    origin: int = 0

    def encode(self) -> bytes:
        return msgpack.packb([self.key, self.namespace_id, self.parent, self.start, self.tokens,
                              self.extra, self.container, self.boundary, self.size, self.checksum, self.origin],
                             use_bin_type=True)

    @classmethod
    def decode(cls, raw: bytes) -> StoredRecord:
        key, ns, parent, start, tokens, extra, container, boundary, size, checksum, origin = msgpack.unpackb(raw, raw=False)
        return cls(key=key, namespace_id=ns, parent=parent, start=start, tokens=tokens, extra=extra,
                   container=container, boundary=boundary, size=size, checksum=checksum,
                   origin=origin)


class ReadOutcome:
    OK = "ok"
    MISSING = "missing"
    CORRUPT = "corrupt"


class LmdbTier:
    def __init__(self, path: Path, disk_bytes: int, sync: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        # Headroom over the payload budget for B-tree pages, records and
        # freed-but-not-yet-reusable pages; grown on MapFullError.
        self._map_size = max(disk_bytes + disk_bytes // 2, 64 << 20)
        self.env = lmdb.open(str(path), map_size=self._map_size, max_dbs=4, subdir=True,
                             sync=sync, metasync=sync, readahead=False, max_readers=256)
        self._meta = self.env.open_db(b"meta")
        self._entries = self.env.open_db(b"entries")
        self._payloads = self.env.open_db(b"payloads")
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lmdb-writer")
        self._readers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="lmdb-reader")
        self._writer_thread: threading.Thread | None = None
        self._check_format()

    # ------------------------------------------------------------ lifecycle

    def _check_format(self) -> None:
        with self.env.begin(write=True, db=self._meta) as txn:
            stored = txn.get(b"format")
            if stored is None:
                txn.put(b"format", str(FORMAT_VERSION).encode())
            elif int(stored) != FORMAT_VERSION:
                raise RuntimeError(
                    f"data_dir {self.path}: LMDB format {int(stored)} is not {FORMAT_VERSION}; "
                    "point data_dir elsewhere or remove it (it is only cache)")

    def close(self) -> None:
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    # ------------------------------------------------------------ writes

    def _write_txn(self, body: Callable[[lmdb.Transaction], None]) -> None:
        """Run one write transaction, growing the map on MapFullError (outside the txn)."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    body(txn)
                return
            except lmdb.MapFullError:
                self._map_size = self._map_size * 3 // 2
                log.warning("LMDB map full; growing it to %d bytes", self._map_size)
                self.env.set_mapsize(self._map_size)

    async def write(self, puts: Sequence[tuple[StoredRecord, Sequence[memoryview]]], deletes: Sequence[bytes]) -> None:
        """Persist records with their payloads and delete keys, all in one transaction.

        The payload views must stay valid until this returns (the caller pins
        their pages)."""

        def body(txn: lmdb.Transaction) -> None:
            for key in deletes:
                txn.delete(_dbkey(key), db=self._entries)
                txn.delete(_dbkey(key), db=self._payloads)
            for record, parts in puts:
                k = _dbkey(record.key)
                value: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
                txn.put(k, value, db=self._payloads)
                txn.put(k, record.encode(), db=self._entries)

        await self._run(self._writer, lambda: self._write_txn(body))

    async def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self.write((), keys)

    async def put_namespace(self, namespace_id: bytes, encoded: bytes) -> None:
        def body(txn: lmdb.Transaction) -> None:
            txn.put(b"ns:" + namespace_id, encoded, db=self._meta)

        await self._run(self._writer, lambda: self._write_txn(body))

    # ------------------------------------------------------------ reads

    def _read_into(self, key: bytes, size: int, checksum: int, dest: Sequence[memoryview]) -> str:
        with self.env.begin(buffers=True) as txn:
            value = txn.get(_dbkey(key), db=self._payloads)
            if value is None:
                return ReadOutcome.MISSING
            if len(value) != size or xxhash.xxh3_64_intdigest(value) != checksum:
                return ReadOutcome.CORRUPT
            pos = 0
            for run in dest:  # copy out before the transaction ends
                run[:] = value[pos : pos + len(run)]
                pos += len(run)
        return ReadOutcome.OK

    async def read_into(self, key: bytes, size: int, checksum: int, dest: Sequence[memoryview]) -> str:
        """Verify the stored payload against ``checksum`` and copy it into ``dest`` (views totalling size)."""
        return await self._run(self._readers, lambda: self._read_into(key, size, checksum, dest))

    def scan(self) -> tuple[dict[bytes, bytes], list[StoredRecord], list[bytes]]:
        """Namespaces, decodable records, and keys whose record is unreadable. Start-up only."""
        namespaces: dict[bytes, bytes] = {}
        records: list[StoredRecord] = []
        broken: list[bytes] = []
        with self.env.begin() as txn:
            for k, v in txn.cursor(db=self._meta):
                if k.startswith(b"ns:"):
                    namespaces[k[3:]] = v
            for k, v in txn.cursor(db=self._entries):
                if not k.startswith(_KEY_PREFIX):
                    continue
                try:
                    records.append(StoredRecord.decode(v))
                except Exception:  # a torn or foreign record: drop it, it is only cache
                    broken.append(k[1:])
        return namespaces, records, broken

    def stat_bytes(self) -> int:
        info = self.env.info()
        stat = self.env.stat()
        return int(info["last_pgno"]) * int(stat["psize"])
