"""The store's NIXL agent: the RAM arena as the target of one-sided READs and WRITEs.

::

    client                                   store (this file)
    POST /v1/nixl/metadata  ---------------> agent metadata (the arena, registered once)
    add_remote_agent(metadata)
    POST /v1/nixl/get {ns, items} ---------> NixlGets.plan (store/nixl_gets.py): prepare_get (pin;
                                             LMDB values pinned in LMDB's map or promoted; checksums),
                                             per payload NIXL or HTTP, one lease
                            <--------------- per item: status, size, xxh3, descriptors; a lease
    READ descriptors -> registered buffers   (one-sided: the store's Python does nothing)
    verify xxh3 of every payload
    POST /v1/release {lease} --------------> unpin; answers whether the lease was still held

    POST /v1/nixl/reserve {ns, items} -----> plan_put: pages reserved, entries pending
                            <--------------- per item: status, descriptors
    WRITE buffers -> descriptors
    POST /v1/nixl/commit {ns, keys} -------> verify xxh3 of the pages, then commit

Decisions:

- **Two registrations, one generation counter.** The arena is one mmap region
  (store/arena.py), registered once at start. LMDB's memory map is the second
  (found in /proc/self/maps: py-lmdb's ``map_addr`` is 0 unless the map is
  fixed), registered at start when ``nixl_map_txns > 0``. The map moves when
  LMDB grows it, so it is then registered again and ``meta_gen`` (in the
  metadata and /v1/nixl/get answers) goes up; a client seeing a new generation
  or another agent name (a store restart) fetches the metadata again.
- **Metadata travels over the store's own HTTP plane** (``/v1/nixl/metadata``,
  behind the tenant token like every /v1 call). NIXL's listener thread is
  never started: it binds every interface and authenticates nothing. The store
  never adds a client's metadata: one-sided READs and WRITEs initiated by the
  client need only the target's, so a client cannot make the store hold state.
- **No progress thread.** NIXL's thread spins a core. Without it, a transfer's
  completion is only acknowledged when the target calls into its agent, so a
  task on the server's loop calls ``get_new_notifs()``: every ``BUSY_PROGRESS_S``
  (1 ms) while a NIXL lease or reservation is outstanding, every ``IDLE_PROGRESS_S``
  (0.1 s) otherwise; handing out a lease or reservation wakes it at once.
- **Leases.** Descriptors are only handed out under a lease (store/leases.py)
  that pins every entry they point into: a pinned entry is never evicted or
  overwritten, so its pages keep its bytes until the lease is released or
  expires. Past expiry the pages may be reused; the client verifies each
  payload's xxh3 after the READ, so a transfer that outlived its lease fails
  (zeroed, counted as a miss) instead of handing out mixed bytes.
- **LMDB-resident entries are READ straight out of LMDB's map** (no copy into
  the arena): one read transaction per /v1/nixl/get (``LmdbTier.pin``, on the
  tier's reader pool) pins every LMDB-resident value of the request; each
  value's xxh3 is verified against its record once, before any descriptor is
  handed out (a client READing into GPU memory cannot hash; a corrupt value is
  answered ``corrupt`` and deleted, as a failed promotion is). The lease owns
  the transaction and ends it on release or expiry; expiry is otherwise lazy,
  so the progress task expires leases while any holds one, and
  ``prefixstore_lmdb_read_txns`` counts the open ones. py-lmdb opens every
  environment ``MDB_NOTLS``: a read transaction begun on a pool thread may be
  aborted on the loop (a lock per pin keeps the two apart). Long read
  transactions keep LMDB from reusing the pages freed after they began; a
  lease is short (``lease_ttl_s``) and at most ``nixl_map_txns`` (default 64
  of LMDB's 256 reader slots) are open. Beyond the cap, with the knob at 0,
  without a store-side map registration, or while the map is growing, values
  are promoted into the arena as before (``prefixstore_nixl_disk_reads_total``
  says which); one that cannot be promoted (RAM full of pinned entries) is
  answered ``http``. LMDB maps its file read-only, so a client WRITE into the
  map fails and changes nothing.
- **The map grows only with no transaction open** (LMDB's rule for
  ``set_mapsize``). On MapFullError the tier stops new reads, these hooks end
  every lease holding a pinned transaction (its READs then fail cleanly: the
  client's xxh3 for host buffers; for buffers it cannot hash, /v1/release
  answers that the lease did not hold) and deregister the map, the tier ends
  any pin left, waits for short reads in flight, grows the map, and the hooks
  register the new one and bump ``meta_gen``, all before the next answer.
- **WRITEs are one-sided too**, so the store cannot stop a client that writes
  after its reservation expired (pending_ttl_s) into pages that were reused.
  The client never starts a WRITE after half the reservation's lifetime, and
  every payload is checksummed at commit and again by every reader; see
  THREAT_MODEL.md for what registered memory means for trust.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from prefixstore.protocol.errors import ItemStatus, Problem
from prefixstore.transport.nixl_agent import NixlUnavailable, import_nixl, make_agent
from prefixstore.protocol.nixl_wire import (
    NixlGetAnswer,
    NixlMetadata,
    NixlPlacements,
    NixlReservation,
    NixlReserveAnswer,
)
from prefixstore.protocol.wire import (
    ItemResult,
    WireError,
    parse_get_items,
    parse_items,
    req_bin,
    req_bool,
    req_entry_keys,
)
from . import nixl_lookup
from .arena import Arena
from .config import StoreConfig
from .http import LOOKUP_NIXL, PROBE_NIXL, STORE, control_header, frame_response, owned, placed
from .index import Entry
from .leases import Leases
from .lmdb_tier import LmdbTier, MapPin
from .metrics import StoreMetrics
from .nixl_gets import NixlGets
from .tasks import stop_task

log = logging.getLogger(__name__)

BUSY_PROGRESS_S = 0.001
"""Progress interval while a NIXL lease or reservation is outstanding. Not zero: over loopback
the initiator copies the bytes itself (UCX cma: process_vm_readv) inside its post call, and the
target only acknowledges completion; a target spinning back to back took the CPU that copy
needs and measured 2-3x slower on 2 cores (1.3-2.2 GB/s vs 3.0-3.9 GB/s at 1 ms, 64 MiB READs;
docs/nixl.md). A transfer's completion is seen up to this late."""

IDLE_PROGRESS_S = 0.1
"""Progress interval of the agent while no NIXL lease or reservation is outstanding. Slow on
purpose: every transfer needs descriptors, handed out only under a lease or reservation, and
handing one out wakes the task at once (``expect_traffic``). Not nothing to do while idle: UCX
sets up a new client's connection only as this agent progresses (a review measured a new
client's first save at 390 ms with the store held idle, 85-100 ms busy); clients connect right
before /v1/nixl/get or /v1/nixl/reserve (client/datapath.py), whose lease or reservation makes
the store busy first. A transfer more than ``BUSY_WINDOW_S`` after its lease was handed out is
progressed at this pace. It was 5 ms: 200 wake-ups a second, each a task and a timer on the
loop, were most of an idle store's CPU (about 4% of a core in a py-spy profile beside two vLLM
replicas, docs/benchmarks.md), and each one preempted whatever ran on that core -- the engines
it shares a host with."""

BUSY_WINDOW_S = 5.0
"""Longest time a single outstanding lease or reservation keeps the progress task busy: a client
that never releases must not keep the loop spinning until its lease expires."""

_PAIR = struct.Struct("<2Q")


def run_descriptors(base: int, page_bytes: int, pages: list[int], offset: int, length: int) -> bytes:
    """(address, length) pairs, uint64 little-endian, covering bytes [offset, offset+length) of an
    entry whose pages start at ``base``; consecutive pages are merged into one descriptor, as
    :meth:`Arena.runs` merges them into one view."""
    end = offset + length
    if length <= 0:
        return b""
    first, last = offset // page_bytes, (end - 1) // page_bytes
    if first == last:  # within one page (a payload of one page, or a layer range inside one)
        return _PAIR.pack(base + pages[first] * page_bytes + offset - first * page_bytes, length)
    out: list[int] = []
    i = first
    while i <= last:
        j = i
        while j < last and pages[j + 1] == pages[j] + 1:
            j += 1
        lo = max(offset, i * page_bytes) - i * page_bytes
        hi = min(end, (j + 1) * page_bytes) - i * page_bytes
        out += (base + pages[i] * page_bytes + lo, hi - lo)
        i = j + 1
    return struct.pack(f"<{len(out)}Q", *out)


class NixlTarget:
    """The store side of the NIXL path; one per store process, made by :meth:`start`.

    It receives the parts it uses (the arena it registers, the leases it grants and ends, the LMDB
    tier whose map it registers, the metrics it counts in) and holds no reference to the store."""

    def __init__(self, agent: Any, name: str, *, arena: Arena, leases: Leases, tier: LmdbTier | None,
                 metrics: StoreMetrics, clock: Callable[[], float], lease_ttl_s: float,
                 pending: Mapping[bytes, Entry]) -> None:
        self.agent = agent
        self.name = name
        self._arena = arena
        self._leases = leases
        self._tier = tier
        self._metrics = metrics
        self._clock = clock
        self._lease_ttl_s = lease_ttl_s
        self._pending = pending  # reservations not yet committed (WritePath.pending): progress while held
        self.base = int(arena.region.ctypes.data)
        self.size = arena.capacity_bytes
        # The only registration this agent ever makes (DESIGN §7: one region).
        self._reg = agent.register_memory([(self.base, self.size, 0, "prefixstore-arena")], "DRAM")
        # Fetched after registering: metadata taken before would not describe the arena.
        self.metadata: bytes = agent.get_agent_metadata()
        self._outstanding: dict[bytes, float] = {}  # lease id / reservation -> loop time handed out
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.progress_errors = 0
        # LMDB's map, registered as a second region while map READs are on (nixl_map_txns > 0).
        self.meta_gen = 0  # bumped whenever the metadata changes (the map moved); in every answer
        self._map_reg: Any = None
        self._map_leases: set[bytes] = set()  # leases holding a pinned LMDB read transaction
        if tier is not None and tier.max_pins > 0:
            self._register_map()
            tier.before_grow.append(self._before_grow)
            tier.after_grow.append(self._after_grow)

    # ------------------------------------------------------------ LMDB's map

    def _register_map(self) -> None:
        tier = self._tier
        region = tier.map_region() if tier is not None else None
        if region is None:
            log.warning("NIXL: LMDB's map cannot be located; LMDB-resident entries are promoted into RAM first")
            return
        try:
            self._map_reg = self.agent.register_memory([(region[0], region[1], 0, "prefixstore-lmdb")], "DRAM")
        except Exception as err:  # then promotion serves them, as with nixl_map_txns = 0
            log.warning("NIXL: registering LMDB's map failed (%s: %s); LMDB-resident entries are promoted "
                        "into RAM first", type(err).__name__, err)
            return
        self.metadata = self.agent.get_agent_metadata()  # it now describes the map too

    def _deregister_map(self) -> None:
        reg, self._map_reg = self._map_reg, None
        if reg is not None:
            try:
                self.agent.deregister_memory(reg)
            except Exception as err:
                log.warning("NIXL: deregistering LMDB's map failed: %s", err)
            self.metadata = self.agent.get_agent_metadata()

    def _before_grow(self) -> None:
        """LMDB's map is about to move: end every lease that holds a pinned read transaction (its
        READs fail cleanly: the release answer says the lease did not hold; xxh3 catches the rest)."""
        revoked = list(self._map_leases)
        for lease in revoked:
            self._leases.release(lease)
        self._metrics.nixl_map_revoked.inc(len(revoked))
        if revoked:
            log.info("NIXL: LMDB's map grows; ended %d leases reading from it", len(revoked))
        self._deregister_map()

    def _after_grow(self) -> None:
        self._register_map()
        self.meta_gen += 1  # clients seeing the new generation fetch the metadata again

    @property
    def map_reads(self) -> bool:
        return self._map_reg is not None

    def lease_pin(self, pin: MapPin, entries: list[Entry], owner: str) -> bytes:
        """A lease over ``entries`` that also ends ``pin`` when it ends (release, expiry, growth)."""
        box: list[bytes] = []

        def on_end() -> None:
            pin.end()
            if box:
                self._map_leases.discard(box[0])

        lease = self._leases.grant(entries, self._clock(), self._lease_ttl_s, on_end=on_end, owner=owner)
        box.append(lease)
        self._map_leases.add(lease)
        return lease

    @classmethod
    def start(cls, arena: Arena, leases: Leases, tier: LmdbTier | None, metrics: StoreMetrics,
              clock: Callable[[], float], lease_ttl_s: float, pending: Mapping[bytes, Entry]) -> NixlTarget:
        if arena.virtual or arena.capacity_bytes == 0:
            raise NixlUnavailable("the arena holds no memory (virtual payloads)")
        agent, name = make_agent("prefixstore-store")
        target = cls(agent, name, arena=arena, leases=leases, tier=tier, metrics=metrics, clock=clock,
                     lease_ttl_s=lease_ttl_s, pending=pending)
        target._task = asyncio.create_task(target._progress_forever(), name="nixl-progress")
        metrics.data_path.labels("nixl").set(1)
        log.info("NIXL data path: agent %s serves the arena (%d bytes at one registration)", name, target.size)
        return target

    async def close(self) -> None:
        self._metrics.data_path.labels("nixl").set(0)
        await stop_task(self._task)
        self._task = None
        tier = self._tier
        if tier is not None:
            for hooks, hook in ((tier.before_grow, self._before_grow), (tier.after_grow, self._after_grow)):
                if hook in hooks:
                    hooks.remove(hook)
        for lease in list(self._map_leases):  # their transactions end before the map is deregistered
            self._leases.release(lease)
        self._deregister_map()
        try:
            self.agent.deregister_memory(self._reg)
        except Exception as err:  # closing: nothing left to protect
            log.warning("NIXL: deregistering the arena failed: %s", err)

    # ------------------------------------------------------------ descriptors

    def descriptors(self, pages: list[int], offset: int, length: int) -> bytes:
        return run_descriptors(self.base, self._arena.page_bytes, pages, offset, length)

    def count_transfer(self, direction: str, nbytes: int) -> None:
        """Payload bytes handed out for READs ("out") or verified after WRITEs ("in") on this path."""
        self._metrics.transfer_bytes.labels(direction, "nixl").inc(nbytes)

    # ------------------------------------------------------------ progress

    def expect_traffic(self, token: bytes) -> None:
        """A lease or reservation was handed out: progress back to back until it ends."""
        self._outstanding[token] = asyncio.get_running_loop().time()
        self._wake.set()

    def traffic_done(self, token: bytes) -> None:
        self._outstanding.pop(token, None)

    def _busy(self, now: float) -> bool:
        if not self._outstanding:
            return False
        leases = self._leases
        pending = self._pending
        stale = [t for t, since in self._outstanding.items()
                 if now - since > BUSY_WINDOW_S or (len(t) == 16 and not leases.holds(t))
                 or (len(t) != 16 and t not in pending)]
        for t in stale:
            del self._outstanding[t]
        return bool(self._outstanding)

    async def _progress_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if self._map_leases:  # expiry is lazy elsewhere; a pinned read transaction must end on time
                self._leases.expire(self._clock())
            try:
                self.agent.get_new_notifs()
            except Exception as err:  # the agent must keep serving; count and go on
                self.progress_errors += 1
                if self.progress_errors in (1, 10, 100) or self.progress_errors % 1000 == 0:
                    log.warning("NIXL progress failed (%d so far): %s", self.progress_errors, err)
            if self._busy(loop.time()):
                await asyncio.sleep(BUSY_PROGRESS_S)
            else:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), IDLE_PROGRESS_S)
                except TimeoutError:
                    pass


# ---------------------------------------------------------------- HTTP plane

@dataclass(slots=True)
class NixlSlot:
    """Where the app keeps its target and the get planner (set after start-up, when the app is
    already frozen)."""

    target: NixlTarget | None = None
    gets: NixlGets | None = None


NIXL = web.AppKey("nixl", NixlSlot)


def _target(request: web.Request) -> NixlTarget:
    target = request.app[NIXL].target
    if target is None:
        raise WireError("nixl", "this store does not serve the NIXL data path (nixl = off, or not installed); "
                        "use /v1/get and /v1/put", Problem.UNKNOWN)
    return target


async def nixl_metadata(request: web.Request) -> web.Response:
    """The store agent's name and metadata (the registered arena). Behind the tenant token like
    every /v1 call: holding the metadata is what lets an agent read the arena (THREAT_MODEL.md)."""
    target = _target(request)
    await control_header(request)  # an empty map; read so a body cannot linger on the connection
    return frame_response(NixlMetadata(agent=target.name, metadata=target.metadata, region=(target.base, target.size),
                                       meta_gen=target.meta_gen).to_header())


async def nixl_get(request: web.Request) -> web.Response:
    """Descriptors of the requested payloads under one lease (released by POST /v1/release); which
    payload goes which way is decided by NixlGets.plan (store/nixl_gets.py)."""
    target = _target(request)
    gets = request.app[NIXL].gets
    assert gets is not None  # set with the target
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    items = parse_get_items(header, store.limits)
    owner = store.owner_of(store.namespace(ns_id))
    plan = await gets.plan(ns_id, owner, items, field="layers" if "keys" in header else "items")
    return frame_response(NixlGetAnswer(agent=target.name, items=plan.items, lease=plan.lease,
                                        lease_ttl_s=plan.lease_ttl_s, meta_gen=target.meta_gen).to_header())


async def nixl_reserve(request: web.Request) -> web.Response:
    """Reserve arena pages for a put whose payloads the client WRITEs; answers their descriptors."""
    target = _target(request)
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    items = parse_items(header, store.limits)
    placed(request, items)  # a cluster node takes only placed items, as /v1/offer and /v1/put do
    await store.room_for(items)  # write-behind: wait for demotable RAM, as /v1/put does
    plan = store.reserve(ns_id, items)  # refused whole over the tenant's quota, as a put is
    out: list[NixlReservation] = []
    for r, e in zip(plan.results, plan.entries):
        if e is not None and r.status is ItemStatus.PENDING and e.pages is not None:
            out.append(NixlReservation(r.status, r.reason, target.descriptors(e.pages, 0, e.size)))
            target.expect_traffic(e.key)
        else:
            out.append(NixlReservation(r.status, r.reason))
    return frame_response(NixlReserveAnswer(agent=target.name, results=tuple(out),
                                            ttl_s=store.config.pending_ttl_s).to_header())


async def nixl_commit(request: web.Request) -> web.Response:
    """After the WRITEs: verify every reserved payload's xxh3 in the arena, then commit (unless
    ``commit`` is false: verified and left pending for a later /v1/commit)."""
    target = _target(request)
    store = request.app[STORE]
    header = await control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    owned(request, ns_id)
    keys = req_entry_keys(header, "keys", store.limits.max_items)
    verified, received = store.verify_pending(ns_id, keys)
    target.count_transfer("in", received)
    results: list[ItemResult] = list(verified)
    if req_bool(header, "commit", default=True):
        todo = [i for i, r in enumerate(results) if r.status is ItemStatus.PENDING]
        committed = await store.commit(ns_id, [keys[i] for i in todo])
        for i, r in zip(todo, committed):
            results[i] = r
    return frame_response({"results": [r.to_wire() for r in results]})


def install(app: web.Application, config: StoreConfig) -> None:
    """Routes of the NIXL path, and the agent's life cycle (after the store opens, before it closes).

    ``nixl = auto`` serves NIXL when the package imports and an agent can be made (HTTP only
    otherwise, said once in the log); ``on`` refuses to start without it; ``off`` never tries."""
    slot = app[NIXL] = NixlSlot()

    def placing(describe: Callable[..., NixlPlacements | None]) -> Callable[[Any, Any], NixlPlacements | None]:
        """A lookup (or cluster probe) asking for it also gets where its payloads lie
        (store/nixl_lookup.py); the lease that pins them keeps the progress task busy."""
        def extension(req: Any, answer: Any) -> NixlPlacements | None:
            target = slot.target
            if target is None:
                return None
            store = app[STORE]
            out = describe(store, target.descriptors, req, answer, target.name, target.meta_gen)
            if out is not None and answer.lease_id is not None:
                target.expect_traffic(answer.lease_id)
                # The client READs these without asking again (no /v1/nixl/get): counted here, when
                # they are handed out under the lease, as /v1/nixl/get counts what it hands out.
                target.count_transfer("out", sum(p.size for p in out.entries))
            return out
        return extension

    app[LOOKUP_NIXL] = placing(nixl_lookup.describe)
    app[PROBE_NIXL] = placing(nixl_lookup.describe_probe)

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        target: NixlTarget | None = None
        store = app[STORE]
        if config.nixl != "off":
            # The one place the NIXL path is wired to the store's parts: the target and the get
            # planner receive them here and never reach through the store afterwards.
            try:
                target = NixlTarget.start(store.arena, store.leases, store.tier, store.metrics, store.clock,
                                          config.lease_ttl_s, store.pending)
            except NixlUnavailable as err:
                if config.nixl == "on":
                    raise RuntimeError(f"nixl: 'on' but {err}") from err
                log.info("NIXL data path not served (HTTP only): %s", err)
        slot.target = target
        if target is not None:
            slot.gets = NixlGets(target, store, store.leases, store.tier, store.metrics, store.clock,
                                 config.lease_ttl_s)
        yield
        slot.target = slot.gets = None
        if target is not None:
            await target.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/nixl/metadata", nixl_metadata)
    app.router.add_post("/v1/nixl/get", nixl_get)
    app.router.add_post("/v1/nixl/reserve", nixl_reserve)
    app.router.add_post("/v1/nixl/commit", nixl_commit)


__all__ = ["NIXL", "NixlSlot", "NixlTarget", "NixlUnavailable", "import_nixl", "install", "make_agent",
           "run_descriptors"]
