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

**Pinned reads (the NIXL map READ).** :meth:`LmdbTier.pin` opens a read
transaction (``buffers=True``), verifies the requested values and keeps the
transaction open in a :class:`MapPin`, so a NIXL agent that registered the map
(:meth:`LmdbTier.map_region`) can let a client READ the values where they lie.
py-lmdb opens every environment with ``MDB_NOTLS``, so a read transaction is
not tied to its thread: a pin is made on the reader pool and ended (aborted)
from the loop; its own lock keeps the two from using it at once. At most
``max_pins`` pins are open (LMDB's reader table has 256 slots; the pool's
short reads need some).

**Growing the map moves it.** ``set_mapsize`` replaces the mapping and LMDB
allows it only while no transaction of this process is active, so
:meth:`_grow` (on the loop) stops new reads, runs ``before_grow`` hooks (the
NIXL target revokes the leases holding pins), ends every pin left, waits on
the writer thread for the short reads in flight to end, grows, and then runs
``after_grow`` hooks (the target registers the new map). Every read
transaction goes through the gate that counts them (``_enter``/``_leave``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import lmdb
import msgpack
import numpy as np
import xxhash

from ..protocol import checksums

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


def _mapping_of(path: str) -> tuple[int, int] | None:
    """(address, length) of this process's mapping of the file ``path``, from /proc/self/maps;
    None where there is no such file (not Linux) or no single mapping of it. py-lmdb's
    ``info()['map_addr']`` is 0 unless the map is fixed (MDB_FIXEDMAP), so it cannot be used."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return None
    found = []
    for line in lines:
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].rstrip("\n") == path:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            found.append((lo, hi - lo))
    return found[0] if len(found) == 1 else None


class PinOutcome:
    """What :meth:`LmdbTier.pin` found for one requested value."""

    __slots__ = ("address", "checksum", "outcome")

    def __init__(self, outcome: str | None, address: int = 0, checksum: int = 0) -> None:
        self.outcome = outcome  # ReadOutcome, or None: not in the map (read it another way)
        self.address = address  # of the requested range's first byte, in the map
        self.checksum = checksum  # xxh3-64 of the requested range


class MapPin:
    """An open read transaction keeping verified values in place in LMDB's map.

    Ended exactly once, by :meth:`end` (lease released or expired, map growth, close), from
    any thread; the tier counts open pins (:attr:`LmdbTier.pinned`)."""

    def __init__(self, tier: LmdbTier) -> None:
        self._tier = tier
        self._lock = threading.Lock()  # held while the pool thread reads through the txn
        self.txn: lmdb.Transaction | None = None
        self.ended = False
        self.revoked = False  # ended by map growth or close, not by its owner

    @property
    def alive(self) -> bool:
        return not self.ended

    def end(self, revoked: bool = False) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended = True
            self.revoked = revoked
            if self.txn is not None:
                self.txn.abort()
                self.txn = None
        self._tier._unpinned(self)


class LmdbTier:
    def __init__(self, path: Path, disk_bytes: int, sync: bool = False, max_pins: int = 0) -> None:
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
        # Every read transaction of this process, short or pinned, is counted under the gate:
        # the map is only grown with none active (see the module docstring).
        self._gate = threading.Condition()
        self._active = 0
        self._growing = False
        self._closed = False
        self._pins: set[MapPin] = set()
        self.max_pins = max_pins
        self.pins_revoked = 0
        self.map_gen = 0  # bumped each time the map moves
        self.before_grow: list[Callable[[], None]] = []  # run on the loop before the map moves
        self.after_grow: list[Callable[[], None]] = []  # ... and after it moved
        self._grow_lock = asyncio.Lock()
        self._check_format()
        self.region = self._find_region()

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
        with self._gate:
            self._closed = True
        for pin in list(self._pins):
            pin.end(revoked=True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()

    # ------------------------------------------------------------ the read gate

    def _enter(self) -> None:
        with self._gate:
            while self._growing:
                self._gate.wait()
            self._active += 1

    def _leave(self) -> None:
        with self._gate:
            self._active -= 1
            self._gate.notify_all()

    def _unpinned(self, pin: MapPin) -> None:
        with self._gate:
            if pin in self._pins:
                self._pins.discard(pin)
                self._active -= 1
                self.pins_revoked += pin.revoked
                self._gate.notify_all()

    @property
    def pinned(self) -> int:
        """Read transactions held open by pins now."""
        return len(self._pins)

    def _find_region(self) -> tuple[int, int] | None:
        region = _mapping_of(os.path.realpath(os.path.join(self.env.path(), "data.mdb")))
        if region is not None and region[1] != self.env.info()["map_size"]:
            return None  # not the map as LMDB sized it: do not guess
        return region

    def map_region(self) -> tuple[int, int] | None:
        """(address, length) of LMDB's memory map now; None where it cannot be found. Moves when
        the map grows (``after_grow`` hooks run then)."""
        return self.region

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    # ------------------------------------------------------------ writes

    def _write_txn(self, body: Callable[[lmdb.Transaction], None]) -> bool:
        """Run one write transaction; False (nothing written) when the map is full."""
        try:
            with self.env.begin(write=True) as txn:
                body(txn)
            return True
        except lmdb.MapFullError:
            return False

    async def _write(self, body: Callable[[lmdb.Transaction], None]) -> None:
        """One write transaction on the writer thread, growing the map (outside any transaction)
        and retrying while it is full."""
        while True:
            gen = self.map_gen
            if await self._run(self._writer, lambda: self._write_txn(body)):
                return
            async with self._grow_lock:
                if gen == self.map_gen:  # nobody grew it meanwhile
                    await self._grow()

    async def _grow(self) -> None:
        with self._gate:
            self._growing = True  # no new read transaction from here (short reads wait, pins are refused)
        try:
            for hook in self.before_grow:
                hook()
            for pin in list(self._pins):
                pin.end(revoked=True)
            await self._run(self._writer, self._remap)
        finally:
            with self._gate:
                self._growing = False
                self._gate.notify_all()
            # On the loop, right after the gate opens: no answer goes out between the two.
            for hook in self.after_grow:
                try:
                    hook()
                except Exception:  # a hook must not fail the write that grew the map
                    log.exception("LMDB after-grow hook failed")

    def _remap(self) -> None:
        with self._gate:
            while self._active:  # short reads in flight finish; pins were all ended
                self._gate.wait()
            self._map_size = self._map_size * 3 // 2
            log.warning("LMDB map full; growing it to %d bytes", self._map_size)
            self.env.set_mapsize(self._map_size)
            self.map_gen += 1
            self.region = self._find_region()

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

        await self._write(body)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self.write((), keys)

    async def put_namespace(self, namespace_id: bytes, encoded: bytes) -> None:
        def body(txn: lmdb.Transaction) -> None:
            txn.put(b"ns:" + namespace_id, encoded, db=self._meta)

        await self._write(body)

    # ------------------------------------------------------------ reads

    def _read_into(self, key: bytes, size: int, checksum: int, dest: Sequence[memoryview]) -> str:
        self._enter()
        try:
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
        finally:
            self._leave()

    def _pin(self, wanted: Sequence[tuple[bytes, int, int, int, int]]) -> tuple[MapPin | None, list[PinOutcome]]:
        with self._gate:
            if self._growing or self._closed or self.region is None or len(self._pins) >= self.max_pins:
                return None, []
            pin = MapPin(self)
            self._pins.add(pin)
            self._active += 1
            base, length = self.region
        out: list[PinOutcome] = []
        with pin._lock:
            if pin.ended:  # revoked before it began (the map is about to grow)
                return None, []
            try:
                pin.txn = txn = self.env.begin(buffers=True)
                values = [txn.get(_dbkey(key), db=self._payloads) for key, *_ in wanted]
                # One check of the batch with the GIL released (protocol/checksums.py): hashing
                # 64 KiB values one by one here would hold it, and the store's loop with it.
                sized = [j for j, (v, w) in enumerate(zip(values, wanted)) if v is not None and len(v) == w[1]]
                verdicts = checksums.verify([values[j] for j in sized], [wanted[j][2] for j in sized])
                intact = {j for j, good in zip(sized, verdicts) if good}
                for j, (key, size, checksum, offset, n) in enumerate(wanted):
                    value = values[j]
                    if value is None:
                        out.append(PinOutcome(ReadOutcome.MISSING))
                        continue
                    if j not in intact:
                        out.append(PinOutcome(ReadOutcome.CORRUPT))
                        continue
                    addr = int(np.frombuffer(value, dtype=np.uint8).ctypes.data) if size else 0
                    if not (base <= addr and addr + size <= base + length):  # not in the map: read it another way
                        out.append(PinOutcome(None))
                        continue
                    part = checksum if offset == 0 and n == size else \
                        xxhash.xxh3_64_intdigest(memoryview(value)[offset : offset + n])
                    out.append(PinOutcome(ReadOutcome.OK, addr + offset, part))
            except BaseException:
                pin.ended = True
                if pin.txn is not None:
                    pin.txn.abort()
                    pin.txn = None
                self._unpinned(pin)
                raise
        if not any(o.outcome == ReadOutcome.OK for o in out):
            pin.end()
            return None, out
        return pin, out

    async def pin(self, wanted: Sequence[tuple[bytes, int, int, int, int]]) -> tuple[MapPin | None, list[PinOutcome]]:
        """Verify stored values and keep them in place: ``wanted`` is (key, size, checksum, offset,
        length) per value, the record's size and xxh3 and the byte range asked for. Returns the pin
        (None: none open, because ``max_pins`` are, the map is growing, it cannot be located, or no
        value was found in place) and one :class:`PinOutcome` per value (empty when refused
        before looking). The caller ends the pin (:meth:`MapPin.end`) when its readers are done."""
        return await self._run(self._readers, lambda: self._pin(wanted))

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
