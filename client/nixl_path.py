"""The client side of the NIXL data path: one agent, registered buffers, one READ or WRITE per batch.

:class:`~prefixstore.client.datapath.DataPath` decides when it is used (``ClientConfig.data_path``)
and falls back to HTTP; :class:`NixlChannel` here speaks the store's NIXL calls (their answers are
the records of protocol/nixl_wire.py) and :class:`NixlPath` knows agents, descriptors and buffers::

    store answer: per payload, runs of the arena as (address, length) pairs
    local side:   the caller's buffer for that payload, cut at the same run lengths
    -> one descriptor list per side, one READ (or WRITE) for the whole batch

Buffers must be registered with the agent. Engines register their staging region once
(:meth:`NixlPath.register`, via ``register_buffer`` on the client); any other buffer a call
passes is registered for that call and deregistered after it (grouped into contiguous runs,
so a batch cut from one array costs one registration).

The agent runs without NIXL's progress thread (it spins a core) and without its listener
thread (it binds every interface unauthenticated): metadata comes over the store's HTTP plane
and this side progresses its transfers by polling their state from the event loop.

nixl is imported lazily; where it is missing, :class:`NixlUnavailable` says so and the client
keeps using HTTP.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from prefixstore.protocol import checksums
from prefixstore.protocol.keys import make_entry_key
from prefixstore.transport.nixl_agent import NixlUnavailable, make_agent
from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.nixl_wire import NixlGetAnswer, NixlMetadata, NixlPlacements, NixlReserveAnswer
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec, WireError, encode_get_items
from .device import DeviceBuffer
from .lru import BoundedLRU

log = logging.getLogger(__name__)

DESC = np.dtype("<u8")


TRANSFER_SPIN_POLLS: Final = 8
"""Polls of a transfer's state back to back (yielding only to the event loop) before pausing:
most loopback transfers are done by then."""

TRANSFER_POLL_PAUSE_S: Final = 0.001
"""Then the loop sleeps this long between polls, its thread blocked in the selector with the GIL
released. A poll loop that only yields to the event loop lets go of the GIL for microseconds at a
time; in an engine process the engine thread, which releases and retakes the GIL around every
torch op, then waits for it each time: in a test (tests/client/test_nixl_poll.py) a thread doing
that got it back a third as often as alone beside a transfer polled that way (1,000-1,100 times
in 0.3 s against 3,800). Not a blocking ``time.sleep``: that would hold up every other coroutine
of the loop, N transfers in flight adding N pauses to each pass (a review measured 256 of them
finishing 34 ms late). 1 ms is also the selector's own granularity and the store's busy progress
interval (store/nixl_target.py), so a completion is seen at most about that late. Over loopback
UCX copies inside the post call and a save's WRITE is done before its first poll
(benchmarks/save_gil.py counts 0 polls): this is for transports where a transfer stays in flight
(RDMA, GPU memory)."""


class TransferFailed(RuntimeError):
    """A READ or WRITE did not complete (error, remote gone, deadline)."""


Dest = memoryview | DeviceBuffer
"""Where a READ lands: host bytes (verified by xxh3 here) or a :class:`DeviceBuffer` (GPU
memory, proven by the lease; client/device.py)."""


def address_of(view: memoryview | DeviceBuffer) -> int:
    """The address of a buffer's first byte (read-only buffers too: they are WRITE sources).
    ctypes first: a fifth of numpy's cost, which counts at a thousand payloads a batch."""
    if isinstance(view, DeviceBuffer):
        return view.address
    if view.nbytes and not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def coalesce(local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge consecutive descriptor pairs that are contiguous on both sides into one (a chain
    stored at once sits on consecutive arena pages, and staging slots are carved back to back):
    UCX pays per descriptor, so 1024 payloads of 64 KiB READ as a few long runs."""
    if len(local) < 2:
        return local, remote
    lengths = local[:, 1]
    joins = ((local[:-1, 0] + lengths[:-1] == local[1:, 0]) & (remote[:-1, 0] + lengths[:-1] == remote[1:, 0])
             & (local[:-1, 2] == local[1:, 2]))
    if not joins.any():
        return local, remote
    starts = np.flatnonzero(np.concatenate([[True], ~joins]))
    merged = np.add.reduceat(lengths, starts)
    return (np.column_stack([local[starts, 0], merged, local[starts, 2]]).astype(np.uint64),
            np.column_stack([remote[starts, 0], merged, remote[starts, 2]]).astype(np.uint64))


def memory_of(views: Sequence[Dest]) -> tuple[str, int]:
    """The NIXL memory type and device of one transfer's local buffers, which must all agree:
    one transfer has one local descriptor list of one memory type."""
    kinds = {(v.memory, v.device) if isinstance(v, DeviceBuffer) else ("DRAM", 0) for v in views}
    if len(kinds) > 1:
        raise ValueError(f"one transfer's buffers must share a memory type and device, got {sorted(kinds)}")
    return kinds.pop() if kinds else ("DRAM", 0)


@dataclass(slots=True)
class _Region:
    start: int
    end: int
    handle: Any
    memory: str = "DRAM"
    device: int = 0


def descriptor_lists(raws: Sequence[object], sizes: Sequence[int], addrs: Sequence[int], device: int = 0
                     ) -> tuple[np.ndarray, np.ndarray]:
    """The two Nx3 (address, length, device) lists of one transfer, built in a few numpy ops.

    ``raws[i]`` is payload i's descriptors from a store answer: (address, length) uint64 pairs
    in its arena, summing to ``sizes[i]``; payload i's local bytes start at ``addrs[i]`` and are
    cut at the same lengths, so the lists pair up run by run::

        remote: | a0 len 40K | a7 len 24K | b3 len 64K |      (payload 0 in two runs, payload 1 in one)
        local:  | x  len 40K | x+40K 24K  | y  len 64K |

    The local list's third column is ``device`` (the CUDA device of GPU buffers), the remote's
    is 0 (the store's arena is host memory). Raises ValueError naming the payload whose
    descriptors are malformed."""
    counts = np.empty(len(raws), dtype=np.int64)
    for i, raw in enumerate(raws):
        if not isinstance(raw, bytes) or not raw or len(raw) % 16:
            raise ValueError(f"[{i}]: descriptors must be non-empty (address, length) uint64 pairs")
        counts[i] = len(raw) // 16
    runs = np.frombuffer(b"".join(raws), dtype=DESC).reshape(-1, 2)  # type: ignore[arg-type]
    lengths = runs[:, 1]
    first = np.zeros(len(raws), dtype=np.int64)
    np.cumsum(counts[:-1], out=first[1:])
    covered = np.add.reduceat(lengths, first)
    bad = np.flatnonzero(covered != np.asarray(sizes, dtype=np.uint64))
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"[{i}]: descriptors cover {int(covered[i])} bytes, the payload is {sizes[i]}")
    before = np.cumsum(lengths) - lengths  # bytes of all earlier runs, every payload
    item = np.repeat(np.arange(len(raws)), counts)
    local_addr = np.asarray(addrs, dtype=np.uint64)[item] + (before - before[first][item])
    zeros = np.zeros(len(lengths), dtype=np.uint64)
    devices = np.full(len(lengths), device, dtype=np.uint64)
    return (np.column_stack([local_addr, lengths, devices]).astype(np.uint64),
            np.column_stack([runs[:, 0], lengths, zeros]).astype(np.uint64))


class NixlPath:
    """One client agent (UCX backend) and the store agent it reads from and writes to."""

    def __init__(self) -> None:
        self.agent, self.name = make_agent(f"prefixstore-client-{os.getpid()}")
        self.remote: str | None = None  # the store agent's name, once its metadata is loaded
        self.remote_gen: int | None = None  # the generation of that metadata (/v1/nixl/metadata's meta_gen)
        self._regions: list[_Region] = []  # registered until close() or unregister()
        self.closed = False

    # ------------------------------------------------------------ the store's agent

    def knows(self, agent_name: str, meta_gen: object = None) -> bool:
        """Whether the loaded metadata is that of agent ``agent_name`` and, when the answer gave
        one, of metadata generation ``meta_gen`` (the store bumps it when LMDB's map moves)."""
        return self.remote is not None and self.remote == agent_name and \
            (not isinstance(meta_gen, int) or meta_gen == self.remote_gen)

    def connect(self, agent_name: str, metadata: bytes, meta_gen: int | None = None) -> None:
        """Load the store agent's metadata (replacing an earlier incarnation's or generation's).
        ``meta_gen`` None: its generation is unknown, so the first answer naming one reloads it."""
        self.forget()
        self.remote_gen = meta_gen
        try:
            loaded = self.agent.add_remote_agent(metadata)
        except Exception as err:  # nixl's errors derive from Exception only
            raise TransferFailed(f"cannot load the store agent's metadata: {type(err).__name__}: {err}") from err
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != agent_name:
            self.agent.remove_remote_agent(name)
            raise TransferFailed(f"the metadata describes agent {name!r}, the store named {agent_name!r}")
        self.remote = name

    def forget(self) -> None:
        if self.remote is not None:
            try:
                self.agent.remove_remote_agent(self.remote)
            except Exception as err:  # already gone: nothing to undo
                log.debug("NIXL: removing agent %s failed: %s", self.remote, err)
            self.remote = None

    # ------------------------------------------------------------ registration

    def register(self, view: memoryview | DeviceBuffer) -> bool:
        """Register a buffer until :meth:`unregister` or :meth:`close`; False if it already is.
        Host memory registers as ``DRAM``, a :class:`DeviceBuffer` as its own memory type."""
        start = address_of(view)
        end = start + view.nbytes
        memory, device = memory_of([view])
        if view.nbytes == 0 or self._covered(start, end, memory, device):
            return False
        try:
            handle = self.agent.register_memory([(start, view.nbytes, device, "")], memory)
        except Exception as err:  # then each call registers it for itself, or fails over to HTTP
            log.warning("NIXL: registering a %d-byte %s buffer failed: %s: %s", view.nbytes, memory,
                        type(err).__name__, err)
            return False
        self._regions.append(_Region(start, end, handle, memory, device))
        return True

    def unregister(self, view: memoryview | DeviceBuffer) -> bool:
        start = address_of(view)
        memory, device = memory_of([view])
        for i, r in enumerate(self._regions):
            if r.start == start and r.end == start + view.nbytes and (r.memory, r.device) == (memory, device):
                del self._regions[i]
                try:
                    self.agent.deregister_memory(r.handle)
                except Exception as err:
                    log.warning("NIXL: deregistering a buffer failed: %s: %s", type(err).__name__, err)
                return True
        return False

    @property
    def registered_memory(self) -> list[str]:
        """The memory kind ('DRAM', 'VRAM') of each region registered once (staging buffers)."""
        return [r.memory for r in self._regions]

    def covers(self, start: int, end: int, memory: str = "DRAM", device: int = 0) -> bool:
        """Whether bytes [start, end) lie inside one region registered once."""
        return self._covered(start, end, memory, device)

    def _covered(self, start: int, end: int, memory: str = "DRAM", device: int = 0) -> bool:
        return any(r.start <= start and end <= r.end and r.memory == memory and r.device == device
                   for r in self._regions)

    def _register_for_call(self, spans: Sequence[tuple[int, int]], memory: str = "DRAM", device: int = 0
                           ) -> list[Any]:
        """Registrations for the spans no registered region covers, merged into contiguous runs
        first (a batch cut from one registered staging region is one coverage check)."""
        if spans:  # the usual case first: one registered staging region holds the whole call
            lo, hi = min(a for a, _ in spans), max(a + n for a, n in spans)
            if self._covered(lo, hi, memory, device):
                return []
        merged: list[list[int]] = []
        for a, b in sorted((a, a + n) for a, n in spans if n):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        merged = [[a, b] for a, b in merged if not self._covered(a, b, memory, device)]
        made: list[Any] = []
        try:
            for a, b in merged:
                made.append(self.agent.register_memory([(a, b - a, device, "")], memory))
        except BaseException:
            for reg in made:
                self.agent.deregister_memory(reg)
            raise
        return made

    # ------------------------------------------------------------ transfers

    async def transfer(self, op: str, local: np.ndarray, remote: np.ndarray,
                       spans: Sequence[tuple[int, int]], timeout_s: float, memory: str = "DRAM",
                       device: int = 0) -> None:
        """One READ (remote -> local) or WRITE (local -> remote) of matching Nx3 descriptor lists.
        ``memory``/``device``: where the local side lives (``VRAM``: GPU memory of that device);
        the remote side is always the store's host memory.

        Polls the transfer from the event loop, yielding between polls (the store's target, when
        it runs in this loop, progresses in between). Raises :class:`TransferFailed`."""
        if self.remote is None:
            raise TransferFailed("no store agent loaded")
        if not len(local):
            return
        local, remote = coalesce(local, remote)
        try:
            temporary = self._register_for_call(spans, memory, device)
        except Exception as err:
            raise TransferFailed(f"registering the call's buffers: {type(err).__name__}: {err}") from err
        handle = None
        settled = True  # False while a transfer may still touch the buffers
        try:
            try:
                handle = self.agent.initialize_xfer(op, self.agent.get_xfer_descs(local, memory),
                                                    self.agent.get_xfer_descs(remote, "DRAM"), self.remote, b"")
                state = self.agent.transfer(handle)
                deadline = time.monotonic() + timeout_s
                polls = 0
                while state == "PROC":
                    if time.monotonic() > deadline:
                        raise TransferFailed(f"{op} not complete within {timeout_s:g}s")
                    polls += 1
                    # Back to back at first, then paced: the GIL to the engine (see the constants).
                    await asyncio.sleep(0 if polls <= TRANSFER_SPIN_POLLS else TRANSFER_POLL_PAUSE_S)
                    state = self.agent.check_xfer_state(handle)
            except TransferFailed:
                raise
            except Exception as err:  # nixl raises its own types (remote disconnected, not found, ...)
                raise TransferFailed(f"{op}: {type(err).__name__}: {err}") from err
            if state != "DONE":
                raise TransferFailed(f"{op} ended in state {state}")
        finally:
            if handle is not None:
                try:
                    self.agent.release_xfer_handle(handle)
                except Exception as err:  # an active transfer that cannot be cancelled; nixl retries at exit
                    settled = False
                    log.warning("NIXL: releasing a transfer handle failed: %s", err)
            # Memory a transfer may still touch stays registered (leaked) rather than pulled from under it.
            for reg in temporary if settled else ():
                try:
                    self.agent.deregister_memory(reg)
                except Exception as err:
                    log.warning("NIXL: deregistering a call's buffer failed: %s", err)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.forget()
        for r in self._regions:
            try:
                self.agent.deregister_memory(r.handle)
            except Exception as err:
                log.debug("NIXL: deregistering failed at close: %s", err)
        self._regions.clear()


# ---------------------------------------------------------------- the protocol over the store's HTTP plane


HASH_CHUNK_BYTES: int | None = None
"""Payload bytes READ per chunk when payloads are hashed: chunk k is hashed on a worker thread
while chunk k+1 is READ (0: one READ, then the hashing). None: :func:`hash_chunk_bytes` picks."""

OVERLAP_CHUNK_BYTES = 8 << 20
"""The chunk :func:`hash_chunk_bytes` picks where overlapping pays. Each chunk costs one
transfer's set-up (tens of microseconds), so chunks stay megabytes."""


def hash_chunk_bytes(sizes: Sequence[int]) -> int:
    """How many payload bytes to READ per chunk when hashing a batch of ``sizes``.

    Overlapping pays where the hashing thread leaves the loop thread the GIL and a core:
    with 4+ cores always (1 MiB GETs on 16 cores: 48% -> 64% of a raw READ); with 2-3 where
    the check releases the GIL (protocol/checksums.py: always with its native loop, otherwise
    only for payloads above 64 KiB; 2 vCPUs: 1 MiB 59-65% -> 65-76% of raw, 128 KiB 59% -> 67%,
    while 64 KiB payloads checked by python-xxhash did not gain); never on one core."""
    if HASH_CHUNK_BYTES is not None:
        return HASH_CHUNK_BYTES
    cores = os.cpu_count() or 1
    if cores < 2 or not sizes or (cores < 4 and not checksums.releases_gil(sizes)):
        return 0
    return OVERLAP_CHUNK_BYTES


def _chunk_bounds(sizes: Sequence[int], chunk_bytes: int) -> list[tuple[int, int]]:
    """Consecutive [a, b) ranges of payloads of about ``chunk_bytes`` each (0: one range)."""
    if not chunk_bytes:
        return [(0, len(sizes))]
    bounds: list[tuple[int, int]] = []
    a = 0
    total = 0
    for j, size in enumerate(sizes):
        total += size
        if total >= chunk_bytes:
            bounds.append((a, j + 1))
            a, total = j + 1, 0
    if a < len(sizes):
        bounds.append((a, len(sizes)))
    return bounds


def _verify_payloads(chunk: Sequence[tuple[Dest, int, int]]) -> list[bool]:
    """Per payload, whether its bytes match its xxh3 (run on a worker thread, or on the loop's
    for a batch READ at once); device memory cannot be hashed here, so it never matches."""
    if all(isinstance(view, memoryview) for view, _, _ in chunk):
        return checksums.verify([view[:size] for view, size, _ in chunk], [c for _, _, c in chunk])  # type: ignore[index]
    return [isinstance(view, memoryview) and checksums.verify([view[:size]], [c])[0] for view, size, c in chunk]


def _zero(view: Dest, size: int) -> None:
    """Zero a payload this side failed to deliver; device memory is left to the caller, which
    cannot use bytes reported as not delivered anyway (client/device.py)."""
    if isinstance(view, memoryview):
        view[:size] = bytes(size)

Call = Callable[[str, dict[str, object]], Awaitable[dict[str, object]]]
"""POST a control frame to the store and return the answer's header (client/node.py ``call`` or
``post``; raises protocol.errors.StoreError, which the data path handles)."""

async def fetch_metadata(call: Call, gen: list[int] | None = None) -> tuple[str, bytes]:
    """The store agent's name and metadata, over the store's authenticated HTTP plane; appends
    the metadata's generation (``meta_gen``, 0 from a store that sends none) to ``gen``."""
    try:
        m = NixlMetadata.from_header(await call("/v1/nixl/metadata", {}))
    except WireError as err:
        raise TransferFailed(f"/v1/nixl/metadata: {err}") from err
    if gen is not None:
        gen.append(m.meta_gen)
    return m.agent, m.metadata


@dataclass(slots=True)
class BatchRead:
    """Per item of a batch: bytes read and verified over NIXL, or -1; which to read over HTTP."""

    sizes: list[int]
    http: list[int] = field(default_factory=list)
    problems: list[tuple[str, str]] = field(default_factory=list)  # (kind, message) for the client's counters
    nixl_bytes: int = 0


def slice_runs(runs: bytes, offset: int, length: int) -> bytes:
    """The (address, length) runs covering bytes [offset, offset + length) of a payload whose
    runs, in order, are ``runs`` (uint64 little-endian pairs). ValueError past their end."""
    pairs = np.frombuffer(runs, dtype=DESC).reshape(-1, 2)
    out: list[int] = []
    pos = 0
    end = offset + length
    for addr, n in pairs.tolist():
        lo, hi = max(offset, pos), min(end, pos + n)
        if lo < hi:
            out += (addr + lo - pos, hi - lo)
        pos += n
        if pos >= end:
            break
    if pos < end or length <= 0:
        raise ValueError(f"bytes [{offset}, {end}) are not inside a {pos}-byte payload")
    return np.asarray(out, dtype=DESC).tobytes()


@dataclass(frozen=True, slots=True)
class Described:
    """One payload a lookup answer placed in the store's arena (store/nixl_lookup.py)."""

    lease: bytes
    deadline: float  # time.monotonic() before which the lease certainly still pins it
    agent: str
    meta_gen: int | None
    size: int
    checksum: int
    runs: bytes


LEASE_MARGIN_S = 1.0
"""Subtracted (at least; a quarter of the lease's lifetime on short leases) from a lookup lease's
lifetime, measured from before the lookup was sent, to get the time until which this client
trusts that the store still pins what the lookup described."""


class LookupRuns:
    """Where the payloads named by recent lookups lie in the store's arena, while their leases last.

    Filled from ``nixl`` parts of lookup answers; a read of a described payload then needs no
    /v1/nixl/get: one READ, checked by its xxh3 where the whole payload lands in host memory,
    and otherwise by time -- the READ completed before the lease's deadline, which this client
    measures from before it sent the lookup, so the store (whose lease started later) certainly
    still pinned the pages. The lookup's lease is released by its owner as after any lookup;
    releasing it here forgets its payloads first."""

    def __init__(self, max_entries: int = 1 << 16) -> None:
        self.max_entries = max_entries
        self._by_key: BoundedLRU[bytes, Described] = BoundedLRU(max_entries)  # newest last: oldest go first

    def __len__(self) -> int:
        return len(self._by_key)

    def add(self, part: NixlPlacements, lease: bytes, sent_at: float) -> int:
        """Remember a lookup answer's ``nixl`` part (validated by its record, protocol/nixl_wire.py);
        returns how many payloads it described."""
        ttl = part.lease_ttl_s
        deadline = sent_at + ttl - max(LEASE_MARGIN_S, ttl / 4)
        if deadline <= time.monotonic():
            return 0
        parsed = [(p.key, Described(lease, deadline, part.agent, part.meta_gen, p.size, p.checksum, p.runs))
                  for p in part.entries]
        for key, described in parsed:
            self._by_key.put(key, described)
        return len(parsed)

    def get(self, key: bytes, now: float) -> Described | None:
        d = self._by_key.get(key)
        if d is not None and d.deadline <= now:
            self._by_key.pop(key)
            return None
        return d

    def forget_lease(self, lease: bytes) -> None:
        for key in [k for k in self._by_key if (d := self._by_key.get(k)) is not None and d.lease == lease]:
            self._by_key.pop(key)

    def clear(self) -> None:
        self._by_key.clear()


class NixlChannel:
    """The NIXL exchange of one client: metadata, descriptors under a lease, READ, verify, release;
    reserve, WRITE, commit. Store failures surface as the ``call``'s exceptions; transfer failures
    as problems, with the items handed back for HTTP."""

    def __init__(self, path: NixlPath, post: Call) -> None:
        self.path = path
        self._post = post  # a call that names no namespace (/v1/nixl/metadata)

    async def connect(self) -> None:
        """Fetch the store agent's metadata over the HTTP plane and load it."""
        gen: list[int] = []
        agent, metadata = await fetch_metadata(self._post, gen)
        self.path.connect(agent, metadata, gen[0])

    async def follow(self, agent: object, meta_gen: object = None) -> None:
        """The answer came from agent ``agent`` with metadata generation ``meta_gen``; load its
        metadata if it is another incarnation, or the same one whose registrations changed
        (LMDB's map moved: the metadata loaded earlier does not describe the new map)."""
        if not isinstance(agent, str):
            raise TransferFailed("answer names no agent")
        if not self.path.knows(agent, meta_gen):
            await self.connect()  # the store restarted (new agent), its map moved, or this is the first call
            if not self.path.knows(agent):
                raise TransferFailed(f"the store's agent changed again (now {self.path.remote}, answered {agent})")

    async def read(self, call: Call, ns_id: bytes, items: Sequence[GetItem], views: Sequence[Dest],
                   verify: bool, timeout_s: float) -> BatchRead:
        """One batch: descriptors under a lease, one READ into ``views``, verify, release.

        A payload is counted only once its bytes are proven: by its xxh3 (host buffers, when
        ``verify``) or by the lease having held until after the READ (buffers that cannot be
        hashed here: :class:`DeviceBuffer`, or ``verify`` off). A host payload that fails is
        zeroed, so no mixed bytes are ever left looking like a result; a device payload that
        fails is reported -1 and left to the caller to zero (client/device.py)."""
        out = BatchRead(sizes=[-1] * len(items))
        memory, device = memory_of(views)
        on_device = any(isinstance(v, DeviceBuffer) for v in views)
        hashed = verify and not on_device
        raw = await call("/v1/nixl/get", {"ns": ns_id, **encode_get_items(items)})
        lease = raw.get("lease")
        ok: list[tuple[int, int, int]] = []  # (item, size, checksum)
        try:
            try:
                answer = NixlGetAnswer.from_header(raw, len(items))
            except WireError as err:
                raise TransferFailed(f"/v1/nixl/get: {err}") from err
            descs: list[object] = []
            for i, it in enumerate(answer.items):
                if it.status is ItemStatus.HTTP:
                    out.http.append(i)
                elif it.status is ItemStatus.OK:
                    if it.size > views[i].nbytes:
                        out.problems.append(("read", f"items[{i}]: a {it.size}-byte payload for a "
                                                     f"{views[i].nbytes}-byte buffer"))
                        continue
                    descs.append(it.runs)
                    ok.append((i, it.size, it.checksum))
                elif it.status is ItemStatus.CORRUPT:
                    out.problems.append(("read", f"items[{i}]: the store found the payload corrupt"))
            if ok:
                await self.follow(answer.agent, answer.meta_gen)
                ok = await self._read_chunks(ok, descs, views, out, hashed, memory, device, timeout_s)
        except TransferFailed as err:
            out.problems.append(("nixl", str(err)))
            out.http.extend(i for i, _, _ in ok)
            ok = []
        finally:
            held = False
            if isinstance(lease, bytes):
                try:
                    held = bool((await call("/v1/release", {"lease": lease})).get("released"))
                except Exception as err:  # the store is gone: the READ's bytes stand on their checksums
                    out.problems.append(("release", f"{type(err).__name__}: {err}"))
        if not hashed and not held:
            # Without checksums only a lease that held until after the READ proves the bytes.
            for i, size, _ in ok:
                if out.sizes[i] >= 0:
                    _zero(views[i], size)
                    out.sizes[i] = -1
                    out.problems.append(("read", f"items[{i}]: the lease expired before the READ was confirmed"))
        out.nixl_bytes = sum(s for s in out.sizes if s > 0)
        return out

    async def read_described(self, views: Sequence[Dest], found: Sequence[tuple[Described, int, int]],
                             verify: bool, timeout_s: float) -> BatchRead:
        """A batch whose payloads a lookup described: (payload, offset, length) per view. One READ
        from the lookup's runs; no /v1/nixl/get and no release (the lookup's lease is its owner's).
        Whole payloads landing in host memory are checked by xxh3 (``verify``), the rest by the
        lease's deadline (:class:`LookupRuns`). ``out.http`` lists the items to read the usual way
        (a failed or unproven READ, another agent or generation, a range outside the payload)."""
        out = BatchRead(sizes=[-1] * len(views))
        memory, device = memory_of(views)
        on_device = any(isinstance(v, DeviceBuffer) for v in views)
        groups: dict[bool, tuple[list[tuple[int, int, int]], list[object]]] = {True: ([], []), False: ([], [])}
        known: dict[tuple[str, int | None], bool] = {}  # per (agent, generation): one check, not one per payload
        for i, (d, offset, length) in enumerate(found):
            ok = known.get((d.agent, d.meta_gen))
            if ok is None:
                ok = known[d.agent, d.meta_gen] = self.path.knows(d.agent, d.meta_gen)
            if length > views[i].nbytes or not ok:
                out.http.append(i)
                continue
            whole = offset == 0 and length == d.size
            try:
                runs = d.runs if whole else slice_runs(d.runs, offset, length)
            except ValueError:
                out.http.append(i)
                continue
            hashed = verify and whole and not on_device
            groups[hashed][0].append((i, length, d.checksum))
            groups[hashed][1].append(runs)
        for hashed, (group, descs) in groups.items():
            if not group:
                continue
            try:
                landed = await self._read_chunks(group, descs, views, out, hashed, memory, device, timeout_s)
            except TransferFailed as err:
                out.problems.append(("nixl", str(err)))
                out.http.extend(i for i, _, _ in group)
                continue
            if hashed:
                continue
            now = time.monotonic()  # the READs completed before this
            for i, size, _ in landed:
                if now >= found[i][0].deadline:
                    _zero(views[i], size)
                    out.sizes[i] = -1
                    out.http.append(i)
                    out.problems.append(("read", f"items[{i}]: READ completed past its lookup lease's deadline"))
        out.nixl_bytes = sum(size for size in out.sizes if size > 0)
        return out

    async def _read_chunks(self, ok: list[tuple[int, int, int]], descs: list[object], views: Sequence[Dest],
                           out: BatchRead, hashed: bool, memory: str, device: int, timeout_s: float
                           ) -> list[tuple[int, int, int]]:
        """READ the payloads ``ok`` names (item, size, checksum), checking each as it lands;
        returns the ones READ (their ``out.sizes`` set once verified, when ``hashed``).

        With hashing, the batch is READ in chunks of about :func:`hash_chunk_bytes` and chunk k is
        hashed on a worker thread while chunk k+1 is READ (the check releases the GIL; over
        loopback UCX copies in this thread), so the check costs about one chunk's hashing, not
        the batch's. A batch READ in one chunk is hashed right here: with nothing to overlap,
        the hop to a worker thread only added latency (1.5 ms a 64 MiB batch on 2 vCPUs).

        A chunk that fails to transfer is zeroed and handed to HTTP with every chunk after it;
        chunks before it keep their verified bytes."""
        try:
            sizes = [size for _, size, _ in ok]
            addrs = [address_of(views[i]) for i, _, _ in ok]
            local, remote = descriptor_lists(descs, sizes, addrs, device)
        except ValueError as err:
            raise TransferFailed(f"/v1/nixl/get: items{err}") from err
        runs = np.fromiter((len(d) // 16 for d in descs), dtype=np.int64, count=len(descs))  # type: ignore[arg-type]
        first_run = np.concatenate([[0], np.cumsum(runs)])
        bounds = _chunk_bounds(sizes, hash_chunk_bytes(sizes) if hashed else 0)
        loop = asyncio.get_running_loop()
        checks: list[asyncio.Future[list[bool]]] = []
        done = len(ok)
        for a, b in bounds:
            lo, hi = int(first_run[a]), int(first_run[b])
            try:
                await self.path.transfer("READ", local[lo:hi], remote[lo:hi], list(zip(addrs[a:b], sizes[a:b])),
                                         timeout_s, memory, device)
            except TransferFailed as err:
                for i, size, _ in ok[a:]:
                    _zero(views[i], size)
                out.problems.append(("nixl", str(err)))
                out.http.extend(i for i, _, _ in ok[a:])  # the HTTP path tries them again
                self.path.forget()  # reload the metadata next time: the store may have restarted
                done = a
                break
            if hashed:
                chunk = [(views[i], size, checksum) for i, size, checksum in ok[a:b]]
                if len(bounds) == 1:  # nothing left to overlap with: a thread hop would only add latency
                    verdict: asyncio.Future[list[bool]] = loop.create_future()
                    verdict.set_result(_verify_payloads(chunk))
                    checks.append(verdict)
                else:
                    checks.append(loop.run_in_executor(None, _verify_payloads, chunk))
        if not hashed:
            for i, size, _ in ok[:done]:
                out.sizes[i] = size  # proven, or withdrawn, by the lease at release
            return ok[:done]
        verdicts = [v for check in await asyncio.gather(*checks) for v in check]
        for (i, size, _), good in zip(ok[:done], verdicts):
            if good:
                out.sizes[i] = size
            else:
                _zero(views[i], size)
                out.problems.append(("checksum", f"items[{i}]: NIXL READ does not match its checksum "
                                                 "(its lease expired mid-transfer?); zeroed"))
        return ok[:done]

    async def write(self, call: Call, ns_id: bytes, specs: Sequence[ItemSpec], views: Sequence[memoryview],
                    commit: bool, timeout_s: float) -> tuple[list[ItemResult], list[tuple[str, str]], int, list[int]]:
        """Reserve pages, WRITE the payloads into them, have the store verify and commit them.
        ``specs`` carry their checksums. Returns per-item results, problems, bytes written and the
        items the store reserved (their payloads were written, or their WRITE failed and they were
        dropped; the reserve decided the others: have, rejected)."""
        started = time.monotonic()
        raw = await call("/v1/nixl/reserve", {"ns": ns_id, "items": [s.to_wire() for s in specs]})
        try:
            answer = NixlReserveAnswer.from_header(raw, len(specs))
        except WireError as err:
            raise TransferFailed(f"/v1/nixl/reserve: {err}") from err
        ttl = answer.ttl_s
        results: list[ItemResult] = []
        todo: list[tuple[int, object]] = []  # (item, its descriptors)
        problems: list[tuple[str, str]] = []
        for i, r in enumerate(answer.results):
            results.append(ItemResult(r.status, r.reason))
            if r.status is ItemStatus.PENDING:
                todo.append((i, r.runs))
        sent = [i for i, _ in todo]
        if not todo:
            return results, problems, 0, sent

        def dropped(detail: str) -> tuple[list[ItemResult], list[tuple[str, str]], int, list[int]]:
            for i, _ in todo:
                results[i] = ItemResult(ItemStatus.DROPPED, Reason.NIXL_FAILED, detail=detail)
            problems.append(("nixl", detail))
            return results, problems, 0, sent

        try:
            await self.follow(answer.agent)
            # Never start a WRITE late: past its reservation the pages may belong to another entry.
            if time.monotonic() - started > float(ttl) / 2:
                return dropped("the reservation is too old to WRITE into")
            sizes = [views[i].nbytes for i, _ in todo]
            addrs = [address_of(views[i]) for i, _ in todo]
            try:
                local, remote = descriptor_lists([d for _, d in todo], sizes, addrs)
            except ValueError as err:
                raise TransferFailed(f"/v1/nixl/reserve: results{err}") from err
            await self.path.transfer("WRITE", local, remote, list(zip(addrs, sizes)),
                                     min(timeout_s, float(ttl) / 2))
        except TransferFailed as err:
            self.path.forget()
            return dropped(f"NIXL WRITE failed: {err}")
        keys = [make_entry_key(specs[i].kind, specs[i].hash) for i, _ in todo]
        done = await call("/v1/nixl/commit", {"ns": ns_id, "keys": keys, "commit": commit})
        committed = done.get("results")
        if not isinstance(committed, list) or len(committed) != len(todo):
            raise TransferFailed(f"/v1/nixl/commit: expected {len(todo)} results")
        written = 0
        for (i, _), r in zip(todo, committed):
            results[i] = ItemResult.from_wire(r)
            if results[i].status in (ItemStatus.OK, ItemStatus.PENDING):
                written += views[i].nbytes
        return results, problems, written, sent


__all__ = ["Dest", "Described", "LookupRuns", "NixlChannel", "NixlPath", "NixlUnavailable", "BatchRead", "TransferFailed", "address_of",
           "descriptor_lists", "fetch_metadata", "hash_chunk_bytes", "memory_of", "slice_runs"]
