"""The LMDB capacity tier: committed entries on local disk, surviving restarts.

Rules (py-lmdb's own advice, kept here because breaking them corrupts or
deadlocks): one writer thread owns every write transaction; reads are short
and run on a small pool; no environment crosses ``fork()``; a ``MapFullError``
grows the map *outside* any transaction and retries; values read with
``buffers=True`` are copied out before their transaction ends.

Three named databases, keys carrying a format version byte::

    meta     b"format"               -> format version
             b"ns:" + ns_id          -> sealed canonical namespace encoding
    entries  v || kind || ns || hash -> sealed msgpack record (what the index needs)
    payloads v || kind || ns || hash -> raw payload bytes

Records and payloads are separate so a restart rebuilds the index by scanning
records only, without touching payload pages. Every payload read verifies the
xxh3-64 checksum in its record before a byte is copied out. Records and
namespace encodings are **sealed**: their own xxh3-64 follows them, and a
record that does not verify is dropped at start-up (the store then also
re-derives every key from the record's contents, store/core.py), so a flipped
byte in a record can never make an entry answer for tokens it does not hold.

**Damage.** LMDB checks page types as it walks its B-trees; a damaged file
raises one of :data:`DAMAGE` instead of returning bytes. A read that meets it
is answered as corrupt (the store drops that entry), never raised. An
environment that cannot be opened or scanned, or a write that meets damage
(:class:`TierDamaged`), is set aside (:meth:`LmdbTier.reset`): for a cache the
right answer to a damaged file is to start empty, loudly, not to stop serving.

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
import errno
import fcntl
import logging
import os
import shutil
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

from prefixstore.protocol import checksums
from .heap import unmap_pages

log = logging.getLogger(__name__)

# 2: store keys scoped by namespace (kind || ns || hash) and sealed records. An environment of
# another format is set aside and the tier starts empty (it is only cache).
FORMAT_VERSION = 2
_KEY_PREFIX = bytes((FORMAT_VERSION,))
T = TypeVar("T")
_SEAL_BYTES = 8
UNMAP_EVERY_BYTES = 64 << 20
"""Bytes copied out of LMDB's map between two :meth:`LmdbTier.let_go` calls."""
#: What LMDB raises on a damaged file (a page of the wrong type, a bad meta page, a panic).
DAMAGE: tuple[type[lmdb.Error], ...] = (
    lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.PanicError, lmdb.BadTxnError, lmdb.InvalidError,
    lmdb.VersionMismatchError, lmdb.IncompatibleError, lmdb.BadDbiError, lmdb.BadRslotError,
    lmdb.MapResizedError)  # resized: no other process shares the file, so its meta page is garbage
QUARANTINE_DIR = "quarantine"


LOCK_FILE = "prefixstore.lock"


class DataDirInUse(RuntimeError):
    """Another process (or another tier in this one) holds the data directory's lock."""


class DataDirLock:
    """An exclusive lock on a data directory, held for the tier's life: ``flock`` on
    ``DATA_DIR/prefixstore.lock``, which holds the holder's PID.

    LMDB itself lets any number of processes share an environment (its lock.mdb coordinates
    them), so without this a second ``prefixstore serve`` on the same directory -- the default
    one, on a developer's machine -- opened the running store's entries, and its ``flush`` deleted
    them under it. A cache node owns its directory alone. ``flock`` (not ``fcntl`` record locks)
    because it belongs to the open file, not the process: a second tier in the same process is
    refused too, and the kernel drops the lock with the process however it ends (kill -9
    included), so a crash never leaves a stale lock to clean up."""

    def __init__(self, path: Path) -> None:
        self.path = path / LOCK_FILE
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
            os.close(fd)
            raise DataDirInUse(f"data_dir: {path} is in use by another prefixstore store (pid {holder}); stop it, "
                               "or give this one another data_dir") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the last descriptor of the open file drops the flock
            self._fd = None


class FormatMismatch(Exception):
    """The environment was written by another format version."""


class TierDamaged(Exception):
    """An LMDB write met a damaged file; the store resets the tier (:meth:`LmdbTier.reset`)."""


class TierFull(Exception):
    """An LMDB write transaction could not reach the disk: no space left (or a quota, a file size
    limit, an I/O error on the way). Its commit failed, so nothing of it was written; the file and
    everything committed before are intact, and a later write may succeed (store/disk.py)."""


_SPACE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
_SPACE_TEXTS = tuple(os.strerror(e) for e in _SPACE_ERRNOS)


def out_of_space(err: lmdb.Error) -> bool:
    """Whether an LMDB error is a write that could not reach the disk, as opposed to damage.

    py-lmdb raises a plain ``lmdb.Error`` carrying strerror's text for system errors, and LMDB
    itself turns a short write (the disk filling in the middle of a commit) into EIO, so a full
    disk reads "mdb_txn_commit: Input/output error" as often as "No space left on device": both
    are taken for a full disk. Before, every such error was taken for damage, and the tier --
    with everything committed before the disk filled -- was deleted."""
    return isinstance(err, lmdb.DiskError) or any(text in str(err) for text in _SPACE_TEXTS)


def db_key(entry_key: bytes) -> bytes:
    return _KEY_PREFIX + entry_key


def seal(raw: bytes) -> bytes:
    """``raw`` followed by its xxh3-64 (little-endian)."""
    return raw + xxhash.xxh3_64_intdigest(raw).to_bytes(_SEAL_BYTES, "little")


def unseal(sealed: bytes) -> bytes | None:
    """The bytes :func:`seal` sealed, or None when they do not verify."""
    if len(sealed) < _SEAL_BYTES:
        return None
    raw, tag = sealed[:-_SEAL_BYTES], sealed[-_SEAL_BYTES:]
    return raw if xxhash.xxh3_64_intdigest(raw).to_bytes(_SEAL_BYTES, "little") == tag else None


@dataclass(frozen=True, slots=True)
class StoredRecord:
    """What the index keeps of an entry, as persisted."""

    key: bytes  # store key (store/index.py): kind || namespace id || hash
    namespace_id: bytes
    parent: bytes | None
    start: int
    tokens: bytes
    extra: bytes
    container: bytes | None  # snapshots: store key of the container
    boundary: int
    size: int
    checksum: int
    origin: int = 0
    record: bool = False  # a cluster's fork record (store/index.py): no payload
    branch: bytes = b""  # cluster: the branch key that placed it (protocol/placement.py)

    def encode(self) -> bytes:
        fields: list[object] = [self.key, self.namespace_id, self.parent, self.start, self.tokens, self.extra,
                                self.container, self.boundary, self.size, self.checksum, self.origin]
        if self.record or self.branch:  # placement fields, only in a cluster: older records have 11
            fields += [self.record, self.branch]
        return seal(msgpack.packb(fields, use_bin_type=True))

    @classmethod
    def decode(cls, sealed: bytes) -> StoredRecord:
        """The record, or ValueError when its seal or any field's type does not hold."""
        raw = unseal(sealed)
        if raw is None:
            raise ValueError("record seal does not verify")
        fields = msgpack.unpackb(raw, raw=False)
        if not isinstance(fields, list) or len(fields) not in (11, 13):
            raise ValueError("record: expected 11 fields (13 with placement)")
        key, ns, parent, start, tokens, extra, container, boundary, size, checksum, origin = fields[:11]
        record, branch = fields[11:] if len(fields) == 13 else (False, b"")
        if not isinstance(record, bool) or not isinstance(branch, bytes):
            raise ValueError("record: a placement field has the wrong type")
        if not all(isinstance(v, bytes) for v in (key, ns, tokens, extra)) \
                or not all(v is None or isinstance(v, bytes) for v in (parent, container)) \
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0
                           for v in (start, boundary, size, checksum, origin)):
            raise ValueError("record: a field has the wrong type")
        return cls(key=key, namespace_id=ns, parent=parent, start=start, tokens=tokens, extra=extra,
                   container=container, boundary=boundary, size=size, checksum=checksum,
                   origin=origin, record=record, branch=branch)


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


@dataclass(frozen=True, slots=True)
class Scan:
    """What :meth:`LmdbTier.scan` found: sealed namespace encodings that verified (by id),
    decodable records, keys whose record did not verify, and why the scan could not finish
    (``damage``: the tier must be reset)."""

    namespaces: dict[bytes, bytes]
    records: list[StoredRecord]
    broken: list[bytes]
    damage: str | None = None


class LmdbTier:
    def __init__(self, path: Path, disk_bytes: int, sync: bool = False, max_pins: int = 0,
                 keep_damaged: bool = False) -> None:
        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._lock = DataDirLock(path)  # before LMDB opens anything: DataDirInUse when another store has it
        self._sync = sync
        self.keep_damaged = keep_damaged
        # Headroom over the payload budget for B-tree pages, records and
        # freed-but-not-yet-reusable pages; grown on MapFullError.
        self._map_size = self._initial_map_size = max(disk_bytes + disk_bytes // 2, 64 << 20)
        self.resets: list[str] = []  # why the environment was set aside, oldest first
        try:
            try:
                self._open()
            except (*DAMAGE, FormatMismatch) as err:  # type: ignore[misc]  # a tuple of exception classes
                # A file LMDB cannot read, or another format's: set it aside and start empty. Not any
                # lmdb.Error: a map larger than the process may map (disk_bytes) is a configuration
                # error, and deleting the data for it would be wrong.
                self._set_aside(f"{type(err).__name__}: {err}")
                self._open()
        except BaseException:
            self._lock.release()
            raise
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
        self.epoch = 0  # bumped each time the environment is set aside (reset): what it held is gone
        self.before_grow: list[Callable[[], None]] = []  # run on the loop before the map moves
        self.after_grow: list[Callable[[], None]] = []  # ... and after it moved
        # The commit seam, for tests: called (on the writer thread) in every write transaction just
        # before it commits; what it raises fails the transaction as a failed mdb_txn_commit would
        # (nothing written). tests/security/test_disk_full.py raises ENOSPC's lmdb.Error through it.
        self.commit_fault: Callable[[], None] | None = None
        self._grow_lock = asyncio.Lock()
        self.region = self._find_region()
        self._copied = 0  # bytes copied out of the map since it was last let go (reader threads; approximate)

    # ------------------------------------------------------------ lifecycle

    def _open(self) -> None:
        self.env = lmdb.open(str(self.path), map_size=self._map_size, max_dbs=4, subdir=True,
                             sync=self._sync, metasync=self._sync, readahead=False, max_readers=256)
        try:
            self._meta = self.env.open_db(b"meta")
            self._entries = self.env.open_db(b"entries")
            self._payloads = self.env.open_db(b"payloads")
            with self.env.begin(write=True, db=self._meta) as txn:
                stored = txn.get(b"format")
                if stored is None:
                    txn.put(b"format", str(FORMAT_VERSION).encode())
                elif stored != str(FORMAT_VERSION).encode():
                    raise FormatMismatch(f"LMDB format {stored[:16]!r} is not {FORMAT_VERSION}")
        except BaseException:
            self.env.close()
            raise
        self._cover_map()

    def _cover_map(self) -> None:
        """Extend data.mdb (sparsely: no blocks are written) to the map's size. LMDB maps the whole
        map; a damaged meta page can send a read past the file's end, which is a SIGBUS that kills
        the process. Past the end of a file this long, the read finds zeros, and LMDB reports
        MDB_CORRUPTED, which the tier handles (the environment is set aside)."""
        path = self.path / "data.mdb"
        try:
            if path.stat().st_size < self._map_size:
                os.truncate(path, self._map_size)
        except OSError as err:  # a file system without sparse files: run as before, loudly
            log.warning("could not extend %s to the LMDB map size: %s", path, err)

    def _set_aside(self, reason: str) -> None:
        """Move (keep_damaged) or delete this environment's files; the tier then opens empty.
        The files go, not the directory: data_dir is often a volume's mount point."""
        self.resets.append(reason)
        aside = self.path / QUARANTINE_DIR
        shutil.rmtree(aside, ignore_errors=True)  # one set aside at most: it is outside disk_bytes
        if self.keep_damaged:
            aside.mkdir()
        for name in ("data.mdb", "lock.mdb"):
            f = self.path / name
            if f.exists():
                if self.keep_damaged:
                    os.replace(f, aside / name)
                else:
                    f.unlink()
        self._map_size = self._initial_map_size
        log.error("LMDB tier at %s could not be used (%s): %s; the tier starts empty", self.path, reason,
                  f"its files were moved to {aside}" if self.keep_damaged else "its files were deleted")

    def close(self) -> None:
        with self._gate:
            self._closed = True
        for pin in list(self._pins):
            pin.end(revoked=True)
        self._writer.shutdown(wait=True)
        self._readers.shutdown(wait=True)
        self.env.close()
        self._lock.release()

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

    def let_go(self) -> None:
        """Drop this process's mapping of every page of LMDB's map (store/heap.py ``unmap_pages``).

        Every value copied out of the map (a promotion, a read buffer) leaves its pages mapped, and
        mapped file pages count in RSS: they grew it by 360 MiB in two minutes of
        benchmarks/pin_soak.py, pages the store no longer needs and the kernel would reclaim anyway.
        Letting each value go after its copy cost a madvise per read (34 us on a 64 KiB value,
        benchmarks/lmdb_reads.py); once every ``UNMAP_EVERY_BYTES`` copied costs one for them all,
        and bounds what reads leave mapped. The data stays in the page cache; a later access (a
        read, a pinned NIXL READ, a B-tree page) maps it again, a minor fault per page."""
        if self.region is not None:
            unmap_pages(*self.region)

    def map_region(self) -> tuple[int, int] | None:
        """(address, length) of LMDB's memory map now; None where it cannot be found. Moves when
        the map grows (``after_grow`` hooks run then)."""
        return self.region

    async def _run(self, pool: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)

    # ------------------------------------------------------------ writes

    def _write_txn(self, body: Callable[[lmdb.Transaction], None]) -> bool:
        """Run one write transaction; False (nothing written) when the map is full. A disk that
        takes no more raises :class:`TierFull` (nothing written, nothing lost); damage, and any
        other error LMDB refuses a write with (a page full, an environment that fails every
        transaction), raises :class:`TierDamaged` (the store then resets the tier)."""
        try:
            with self.env.begin(write=True) as txn:
                body(txn)
                if self.commit_fault is not None:
                    self.commit_fault()
            return True
        except lmdb.MapFullError:
            return False
        except lmdb.Error as err:
            if not isinstance(err, DAMAGE) and out_of_space(err):
                raise TierFull(f"{type(err).__name__}: {err}") from err
            raise TierDamaged(f"{type(err).__name__}: {err}") from err

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

    async def reset(self, reason: str) -> None:
        """Set the damaged environment aside and continue on an empty one (the caller has dropped
        every entry from its index). The same dance as growing the map: no read in flight, pins
        revoked, hooks told that the map moved.

        ``epoch`` moves on *before* anything is awaited: a write in flight whose caller compares the
        epoch it started under knows, whenever it completes, that what it wrote is gone."""
        self.epoch += 1
        async with self._grow_lock:
            with self._gate:
                self._growing = True
            try:
                for hook in self.before_grow:
                    hook()
                for pin in list(self._pins):
                    pin.end(revoked=True)
                await self._run(self._writer, lambda: self._reopen(reason))
            finally:
                with self._gate:
                    self._growing = False
                    self._gate.notify_all()
                for hook in self.after_grow:
                    try:
                        hook()
                    except Exception:
                        log.exception("LMDB after-grow hook failed")

    def _reopen(self, reason: str) -> None:
        with self._gate:
            while self._active:
                self._gate.wait()
            self.env.close()
            self._set_aside(reason)
            self._open()
            self.map_gen += 1
            self.region = self._find_region()

    def _remap(self) -> None:
        with self._gate:
            while self._active:  # short reads in flight finish; pins were all ended
                self._gate.wait()
            self._map_size = self._map_size * 3 // 2
            log.warning("LMDB map full; growing it to %d bytes", self._map_size)
            self.env.set_mapsize(self._map_size)
            self._cover_map()
            self.map_gen += 1
            self.region = self._find_region()

    async def write(self, puts: Sequence[tuple[StoredRecord, Sequence[memoryview]]], deletes: Sequence[bytes]) -> None:
        """Persist records with their payloads and delete keys, all in one transaction.

        The payload views must stay valid until this returns (the caller pins
        their pages)."""

        def body(txn: lmdb.Transaction) -> None:
            for key in deletes:
                txn.delete(db_key(key), db=self._entries)
                txn.delete(db_key(key), db=self._payloads)
            for record, parts in puts:
                k = db_key(record.key)
                value: bytes | memoryview = parts[0] if len(parts) == 1 else b"".join(parts)
                txn.put(k, value, db=self._payloads)
                txn.put(k, record.encode(), db=self._entries)

        await self._write(body)

    async def delete(self, keys: Sequence[bytes]) -> None:
        if keys:
            await self.write((), keys)

    async def put_namespace(self, namespace_id: bytes, encoded: bytes) -> None:
        def body(txn: lmdb.Transaction) -> None:
            txn.put(b"ns:" + namespace_id, seal(encoded), db=self._meta)

        await self._write(body)

    async def delete_namespace(self, namespace_id: bytes) -> None:
        def body(txn: lmdb.Transaction) -> None:
            txn.delete(b"ns:" + namespace_id, db=self._meta)

        await self._write(body)

    # ------------------------------------------------------------ reads

    def _read_into(self, key: bytes, size: int, checksum: int, dest: Sequence[memoryview], offset: int) -> str:
        self._enter()
        try:
            with self.env.begin(buffers=True) as txn:
                value = txn.get(db_key(key), db=self._payloads)
                if value is None:
                    return ReadOutcome.MISSING
                if len(value) != size or xxhash.xxh3_64_intdigest(value) != checksum:
                    return ReadOutcome.CORRUPT
                pos = offset
                for run in dest:  # copy out before the transaction ends
                    run[:] = value[pos : pos + len(run)]
                    pos += len(run)
            self._copied += size
            if self._copied >= UNMAP_EVERY_BYTES:  # inside the gate: the map cannot move under it
                self._copied = 0
                self.let_go()
            return ReadOutcome.OK
        except lmdb.Error as err:  # a damaged page on the way to this value: it is lost, the tier serves on
            log.warning("LMDB read of %s met damage (%s: %s)", key.hex(), type(err).__name__, err)
            return ReadOutcome.CORRUPT
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
                try:
                    values = [txn.get(db_key(key), db=self._payloads) for key, *_ in wanted]
                except lmdb.Error:  # let each value be read (and judged) on its own: _read_into
                    pin.ended = True
                    pin.txn.abort()
                    pin.txn = None
                    self._unpinned(pin)
                    return None, []
                # One check of the batch with the GIL released (protocol/checksums.py): hashing
                # 64 KiB values one by one here would hold it, and the store's loop with it.
                sized = [j for j, (v, w) in enumerate(zip(values, wanted)) if v is not None and len(v) == w[1]]
                verdicts = checksums.verify([v for j in sized if (v := values[j]) is not None],
                                            [wanted[j][2] for j in sized])
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

    async def read_into(self, key: bytes, size: int, checksum: int, dest: Sequence[memoryview],
                        offset: int = 0) -> str:
        """Verify the whole stored payload against ``checksum`` and copy its bytes from ``offset``
        on into ``dest`` (views totalling at most ``size - offset``: a range, or all of it)."""
        return await self._run(self._readers, lambda: self._read_into(key, size, checksum, dest, offset))

    def scan(self) -> Scan:
        """Namespaces, decodable records, and keys whose record is unreadable. Start-up only."""
        namespaces: dict[bytes, bytes] = {}
        records: list[StoredRecord] = []
        broken: list[bytes] = []
        try:
            with self.env.begin() as txn:
                for k, v in txn.cursor(db=self._meta):
                    if k.startswith(b"ns:"):
                        raw = unseal(v)
                        if raw is not None:  # else dropped: its entries are dropped with it
                            namespaces[k[3:]] = raw
                for k, v in txn.cursor(db=self._entries):
                    if not k.startswith(_KEY_PREFIX):
                        continue
                    try:
                        record = StoredRecord.decode(v)
                    except Exception:  # a torn, flipped or foreign record: drop it, it is only cache
                        broken.append(k[1:])
                        continue
                    if record.key != k[1:]:
                        broken.append(k[1:])
                    else:
                        records.append(record)
        except lmdb.Error as err:
            return Scan({}, [], [], damage=f"{type(err).__name__}: {err}")
        return Scan(namespaces, records, broken)

    def stat_bytes(self) -> int:
        info = self.env.info()
        stat = self.env.stat()
        return int(info["last_pgno"]) * int(stat["psize"])
