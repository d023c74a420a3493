"""The one data path of a node client: how payloads move, and the fallback between its two roads.

::

    read / write ──► NIXL usable? ──yes──► placed by a lookup? ─► one READ of its runs (no round trip)
                        │                        └─► /v1/nixl/get (or /reserve) + one READ (WRITE) per batch
                        │                               └─► what NIXL did not deliver nor prove missing ─┐
                        └──no────────────────────────────────────────────────────────────────────────────┴─► HTTP

HTTP (``/v1/get`` on the frame transport, payloads received straight into the caller's buffers;
``/v1/put`` sending them from there) always works. NIXL (client/nixl_path.py) is used when
``ClientConfig.data_path`` allows it, nixl imports here and the store serves it. This class owns
that decision once: whether NIXL is off for good (not installed, not served) or for a while (a
transient failure, retried after ``warn_interval_s``), the staging buffers registered before an
agent exists, the payloads recent lookups placed, and the one log line that says which road is
in use. Failures are counted (client/failures.py), never raised.
"""

from __future__ import annotations

import importlib.util
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import numpy as np

from prefixstore.protocol.errors import ItemStatus, Problem, Reason, StoreError
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.nixl_wire import NixlPlacements
from prefixstore.transport.frames import FramePool, get_into
from prefixstore.protocol.wire import GetItem, ItemResult, ItemSpec, WireError, encode_get_items, encode_header
from .config import ClientConfig
from .device import DeviceBuffer
from .failures import Failures
from .nixl_path import (
    BatchRead,
    Described,
    Dest,
    LookupRuns,
    NixlChannel,
    NixlPath,
    NixlUnavailable,
    TransferFailed,
    fetch_metadata,
)

log = logging.getLogger(__name__)

Buffer = bytearray | memoryview | np.ndarray
"""A writable buffer the client fills (bytearray, memoryview, numpy array)."""

Call = Callable[[str, dict[str, object]], Awaitable[dict[str, object]]]


class NodeCalls(Protocol):
    """What the data path needs of its node client (client/node.py)."""

    @property
    def pool(self) -> FramePool: ...

    async def call(self, path: str, header: dict[str, object],
                   payloads: Sequence[bytes | memoryview] = ()) -> dict[str, object]:
        """A call on the namespace (registered first, and again if the store forgot it)."""

    async def post(self, path: str, header: dict[str, object]) -> dict[str, object]:
        """A call that names no namespace."""

    async def ensure_namespace(self) -> None: ...

    def forget_namespace(self) -> None: ...


def as_view(buf: Buffer) -> memoryview:
    """A flat byte view of a buffer (numpy arrays must be C-contiguous)."""
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("output buffers must be C-contiguous")
        return buf.reshape(-1).view(np.uint8).data.cast("B")
    return memoryview(buf).cast("B")


def batches(sizes: list[int], max_bytes: int, max_items: int) -> list[list[int]]:
    """Consecutive item indices cut into batches of at most ``max_items`` items and ``max_bytes``
    buffer bytes (an item larger than ``max_bytes`` goes alone); one batch when all fit."""
    if len(sizes) <= max_items and sum(sizes) <= max_bytes:
        return [list(range(len(sizes)))] if sizes else []
    out: list[list[int]] = []
    batch: list[int] = []
    budget = 0
    for i, n in enumerate(sizes):
        if batch and (budget + n > max_bytes or len(batch) >= max_items):
            out.append(batch)
            batch, budget = [], 0
        batch.append(i)
        budget += n
    if batch:
        out.append(batch)
    return out


def nixl_installed() -> bool:
    """Whether the nixl package exists here, without importing it (seconds with torch installed)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):  # ValueError: a module hidden by sys.modules["nixl"] = None
        return False


def nixl_refused(err: StoreError) -> bool:
    """The store answered that it does not serve NIXL (404 naming the field 'nixl')."""
    return err.is_refusal(Problem.UNKNOWN, "nixl")


def results_of(answer: dict[str, object], n: int) -> list[ItemResult]:
    raw = answer.get("results")
    if not isinstance(raw, list) or len(raw) != n:
        raise WireError("results", f"expected {n} results")
    return [ItemResult.from_wire(r) for r in raw]


class DataPath:
    def __init__(self, namespace: Namespace, config: ClientConfig, node: NodeCalls, failures: Failures) -> None:
        self._ns = namespace
        self._config = config
        self._node = node
        self._failures = failures
        self.bytes_moved: Counter[str] = Counter()
        """Payload bytes moved, by road ('nixl', 'http'): which road the data actually took."""
        self.channel: NixlChannel | None = None
        """The NIXL exchange once an agent exists (a documented seam: tests look at its agent)."""
        self._off: str | None = None  # why NIXL is not used for good (None: not decided, or in use)
        self._retry_at = 0.0  # after a transient failure, when to try NIXL again
        self._logged: str | None = None
        self._pending_buffers: list[Dest] = []  # registered once an agent exists
        self.placements = LookupRuns()
        """Payloads recent lookups placed in the store's registered memory (NIXL)."""

    # ------------------------------------------------------------ state

    @property
    def name(self) -> str:
        """'nixl' or 'http': the road payloads take now ('undecided' before the first transfer)."""
        if self.connected:
            return "nixl"
        if self._config.data_path == "http" or self._off is not None:
            return "http"
        return "undecided"

    @property
    def connected(self) -> bool:
        """This client's agent is connected to the store's: answers may place payloads for it."""
        return self.channel is not None and self.channel.path.remote is not None

    @property
    def nixl_possible(self) -> bool:
        """NIXL is neither configured off nor found unusable for good."""
        return self._config.data_path != "http" and self._off is None

    def register(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a staging buffer with the NIXL agent, once (see NodeClient.register_buffer)."""
        if self._config.data_path == "http":
            return False
        view = buf if isinstance(buf, DeviceBuffer) else as_view(buf)
        if self.channel is None:
            self._pending_buffers.append(view)
            return True
        return self.channel.path.register(view) or True

    def unregister(self, buf: Buffer | DeviceBuffer) -> bool:
        view = buf if isinstance(buf, DeviceBuffer) else as_view(buf)
        self._pending_buffers = [v for v in self._pending_buffers if v is not view]
        return self.channel.path.unregister(view) if self.channel is not None else False

    def place(self, part: NixlPlacements, lease: bytes, sent_at: float) -> None:
        """Remember where a lookup's (or probe's) answer placed its payloads, for its lease."""
        self.placements.add(part, lease, sent_at)

    def forget_lease(self, lease: bytes) -> None:
        self.placements.forget_lease(lease)  # before its release: its runs must not be READ once it may end

    def close(self) -> None:
        if self.channel is not None:
            self.channel.path.close()
            self.channel = None

    def _use(self, road: str, why: str) -> None:
        """One log line when the road is decided or changes."""
        if self._logged != road:
            self._logged = road
            log.info("prefixstore data path: %s (%s)", road, why)

    def _disable(self, reason: str, permanent: bool) -> None:
        if self._config.data_path == "nixl":
            self._failures.record("nixl", f"NIXL data path unavailable, using HTTP: {reason}")
        if permanent:
            self._off = reason
        else:
            self._retry_at = time.monotonic() + self._config.warn_interval_s
        self._use("http", reason)

    async def ready(self) -> NixlChannel | None:
        """The NIXL channel when NIXL is usable now, else None (use HTTP)."""
        if not self.nixl_possible:
            if self._config.data_path == "http":
                self._use("http", "data_path = http")
            return None
        if self.connected:
            return self.channel
        if time.monotonic() < self._retry_at:
            return None
        if self.channel is None and not nixl_installed():
            self._disable("nixl is not installed here (pip install nixl)", permanent=True)
            return None
        try:
            gen: list[int] = []
            agent, metadata = await fetch_metadata(self._node.post, gen)  # before making an agent: is NIXL served?
            if self.connected and self.channel is not None and self.channel.path.knows(agent, gen[0] if gen else None):
                # Another caller connected while this one asked (a first save beside prepare()):
                # connecting again would drop the store's agent under its transfers.
                return self.channel
            if not self.make_agent():
                return None
            assert self.channel is not None
            self.channel.path.connect(agent, metadata, gen[0] if gen else None)
        except StoreError as err:
            refused = nixl_refused(err)
            self._disable(f"the store does not serve NIXL: {err}" if refused
                          else f"cannot ask the store for its NIXL agent: {err}", permanent=refused)
            return None
        except (TransferFailed, WireError) as err:
            self._disable(f"cannot load the store's NIXL agent: {err}", permanent=False)
            return None
        assert self.channel is not None
        self._use("nixl", f"store agent {self.channel.path.remote}")
        return self.channel

    def make_agent(self) -> bool:
        """This client's agent, made once, with the buffers registered so far; False where NIXL
        cannot run here (then off for good)."""
        if self.channel is None:
            try:
                path = NixlPath()
            except NixlUnavailable as err:
                self._disable(str(err), permanent=True)
                return False
            self.channel = NixlChannel(path, self._node.post)
            for view in self._pending_buffers:
                path.register(view)
            self._pending_buffers = []
        return True

    async def prepare(self) -> bool:
        """Set up ahead of the first transfer (PrefixClient.prepare): connected to the store's agent
        where it can be asked now. Where it cannot (down, still starting), the agent is made all the
        same: that is the costly part, and a later transfer then only loads the store's metadata.
        Not where the store said it serves no NIXL, or NIXL is configured off."""
        if await self.ready() is not None:
            return True
        if self.nixl_possible and self._config.data_path != "http" and nixl_installed():
            self.make_agent()
        return False

    def _account(self, got: BatchRead) -> None:
        self.bytes_moved["nixl"] += got.nixl_bytes
        for kind, message in got.problems:
            if kind == "checksum":
                self._failures.count("checksum")
            self._failures.record("nixl" if kind == "nixl" else "read", message)
        if any(kind == "nixl" for kind, _ in got.problems):
            self._use("http", "a NIXL transfer failed; HTTP until the agent is reloaded")

    # ------------------------------------------------------------ reads

    async def read(self, items: Sequence[GetItem], views: list[memoryview], batch: list[int], done: list[int]) -> None:
        """One batch into host buffers: NIXL when usable (one READ), HTTP for everything it did not
        deliver and could not prove missing."""
        channel = await self.ready()
        if channel is not None and len(self.placements):
            batch = await self._read_placed(channel, items, views, batch, done)
            if not batch:
                return
        if channel is not None:
            try:
                got = await channel.read(self._node.call, self._ns.id, [items[i] for i in batch],
                                         [views[i] for i in batch], self._config.verify_checksums,
                                         self._config.timeout_s)
            except StoreError as err:
                if not nixl_refused(err):
                    self._failures.record("read", err)
                    return
                self._disable(f"the store stopped serving NIXL: {err}", permanent=True)
            else:
                for i, size in zip(batch, got.sizes):
                    done[i] = size
                self._account(got)
                batch = [batch[j] for j in got.http]
                if not batch:
                    return
        await self._read_http(items, views, batch, done)

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer], batch: list[int],
                          done: list[int]) -> None:
        """One batch READ over NIXL straight into device memory (no HTTP road exists for it)."""
        channel = await self.ready() if self.nixl_possible else None
        if channel is None:
            return
        if len(self.placements):
            batch = await self._read_placed(channel, items, outs, batch, done)
            if not batch:
                return
        try:
            got = await channel.read(self._node.call, self._ns.id, [items[i] for i in batch],
                                     [outs[i] for i in batch], self._config.verify_checksums, self._config.timeout_s)
        except StoreError as err:
            if nixl_refused(err):
                self._disable(f"the store stopped serving NIXL: {err}", permanent=True)
            else:
                self._failures.record("read", err)
            return
        for i, size in zip(batch, got.sizes):
            done[i] = size
        self._account(got)

    async def _read_placed(self, channel: NixlChannel, items: Sequence[GetItem], views: Sequence[Dest],
                           batch: list[int], done: list[int]) -> list[int]:
        """READ the batch's payloads that a recent lookup placed (no /v1/nixl/get); returns the
        items left for the usual road."""
        now = time.monotonic()
        ns = self._ns
        token_bytes = ns.kv.token_bytes
        found: list[tuple[Described, int, int]] = []
        which: list[int] = []
        rest: list[int] = []
        for i in batch:
            item = items[i]
            d = self.placements.get(item.key, now)
            if d is None:
                rest.append(i)
                continue
            if item.whole:
                offset, length = 0, d.size
            elif not item.all_heads:
                # A head range (a run per layer and component) goes the usual road: the store describes it.
                rest.append(i)
                continue
            else:
                is_state = item.key[0] == Kind.STATE
                tokens = 0 if is_state or not token_bytes else d.size // token_bytes
                try:
                    offset, length = ns.payload_range(is_state, tokens, item.layer_start, item.layer_end)
                except ValueError:
                    rest.append(i)
                    continue
                if self._config.verify_checksums and (offset, length) != (0, d.size):
                    # The store keeps one xxh3 per payload: a layer range less than the whole payload
                    # is checked only when the store hashes it for /v1/nixl/get. Unchecked bytes only
                    # where the operator turned checks off. A range that is the whole payload (every
                    # layer, named: a load of all layers asks [0, num_layers)) is checked here by
                    # that xxh3, and READ at once.
                    rest.append(i)
                    continue
            found.append((d, offset, length))
            which.append(i)
        if not found:
            return batch
        got = await channel.read_described([views[i] for i in which], found, self._config.verify_checksums,
                                           self._config.timeout_s)
        for i, size in zip(which, got.sizes):
            done[i] = size
        self._account(got)
        if any(kind == "nixl" for kind, _ in got.problems):
            self.placements.clear()  # the agent is reloaded: its runs may name another incarnation
        return sorted(rest + [which[j] for j in got.http])

    async def _read_http(self, items: Sequence[GetItem], views: list[memoryview], batch: list[int],
                         done: list[int]) -> None:
        """One POST /v1/get on the frame transport: payloads land straight in ``views``."""
        request = encode_header({"ns": self._ns.id, **encode_get_items([items[i] for i in batch])})
        batch_views = [views[i] for i in batch]
        try:
            await self._node.ensure_namespace()
        except StoreError as err:
            self._failures.record("read", err)
            return
        verify = self._config.verify_checksums
        result = await get_into(self._node.pool, request, batch_views, timeout_s=self._config.timeout_s, verify=verify)
        if result.error is not None and result.error.is_refusal(Problem.UNKNOWN, "ns"):
            # The store forgot the namespace (a restart): register again and retry once.
            self._node.forget_namespace()
            try:
                await self._node.ensure_namespace()
            except StoreError as err:
                self._failures.record("read", err)
                return
            result = await get_into(self._node.pool, request, batch_views, timeout_s=self._config.timeout_s,
                                    verify=verify)
        # Only payloads received whole and verified have a size here; anything
        # partially written by a failed exchange stays -1.
        for i, size in zip(batch, result.sizes):
            done[i] = size
        self.bytes_moved["http"] += sum(size for size in result.sizes if size > 0)
        for kind, message in result.problems:
            if kind == "checksum":
                self._failures.count("checksum")
            self._failures.record("read", message)
        if result.error is not None:
            self._failures.record("read", result.error)

    # ------------------------------------------------------------ writes

    async def write(self, specs: Sequence[ItemSpec], views: list[memoryview], commit: bool) -> list[ItemResult]:
        """One batch of checksummed items and their payloads: NIXL WRITEs when usable, else one
        HTTP put. A failure drops the batch (``dropped``), counted; quota refusals say so."""
        channel = await self.ready()
        if channel is not None:
            got = await self._write_nixl(channel, specs, views, commit, quota_whole=True)
            if got is not None:
                return got[0]
        got = await self._put_http(specs, views, commit, quota_whole=True)
        assert got is not None
        return got[0]

    async def _put_http(self, specs: Sequence[ItemSpec], views: list[memoryview], commit: bool,
                        quota_whole: bool) -> tuple[list[ItemResult], list[int]] | None:
        """The batch as one HTTP put: its results and the items sent (all). None where, unless
        ``quota_whole``, the store refused it whole over the tenant's quota (nothing counted: the
        caller offers instead)."""
        sent = list(range(len(specs)))
        try:
            answer = await self._node.call("/v1/put", {"ns": self._ns.id, "commit": commit,
                                                       "items": [x.to_wire() for x in specs]}, views)
            results = results_of(answer, len(specs))
        except StoreError as err:
            if not quota_whole and err.is_refusal(Problem.QUOTA):
                return None
            return self._dropped(len(specs), err), sent
        except WireError as err:
            self._failures.record("put", err)
            return [ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)] * len(specs), sent
        self.bytes_moved["http"] += sum(v.nbytes for v, r in zip(views, results) if r.status is ItemStatus.OK)
        refused = sum(r.reason is Reason.QUOTA for r in results)
        if refused:  # never a silent drop: counted and warned like a failure
            self._failures.record("quota", f"{refused} item(s) refused: {Reason.QUOTA.text}")
        return results, sent

    async def write_unoffered(self, specs: Sequence[ItemSpec], views: list[memoryview]
                              ) -> tuple[list[ItemResult], list[int]] | None:
        """A save's batch sent with no offer before it (NodeClient.save, where ``small_save_bytes``
        is above 0). Returns the results (committed) and the items whose payloads were sent, or
        None where the batch must be offered first.

        * At most ``small_save_bytes`` of payload: one HTTP put, NIXL or not. The store still
          decides each item; what it holds or refuses traveled for nothing, a bounded waste that
          costs less than the round trip an offer takes.
        * Larger, over NIXL: the reserve answers have / rejected / reserved per item before any
          byte moves, and only what it reserved is written. It decides as an offer does on a
          single node (on a cluster node both refuse an item without a branch; cluster saves go
          through client/saves.py, which offers).
        * Larger, over HTTP (a put would carry every payload before the store decides), NIXL just
          turned off, or a batch refused whole over its tenant's quota (an offer answers that per
          item, and the part that fits is stored): None."""
        if sum(v.nbytes for v in views) <= self._config.small_save_bytes:
            return await self._put_http(specs, views, True, quota_whole=False)
        channel = await self.ready()
        if channel is None:
            return None
        return await self._write_nixl(channel, specs, views, True, quota_whole=False)

    async def _write_nixl(self, channel: NixlChannel, specs: Sequence[ItemSpec], views: list[memoryview],
                          commit: bool, quota_whole: bool) -> tuple[list[ItemResult], list[int]] | None:
        """The batch over NIXL: its results and the items whose payloads were sent. None where it
        goes another way: the store stopped serving NIXL (turned off here), or, unless
        ``quota_whole``, a whole-batch quota refusal (nothing counted: the caller offers instead)."""
        try:
            results, problems, written, sent = await channel.write(self._node.call, self._ns.id, specs, views,
                                                                   commit, self._config.timeout_s)
        except StoreError as err:
            if nixl_refused(err):
                self._disable(f"the store stopped serving NIXL: {err}", permanent=True)
                return None
            if not quota_whole and err.is_refusal(Problem.QUOTA):
                return None
            return self._dropped(len(specs), err), []
        except (TransferFailed, WireError) as err:
            self._failures.record("put", err)
            return [ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE)] * len(specs), []
        self.bytes_moved["nixl"] += written
        for kind, message in problems:
            self._failures.record("nixl" if kind == "nixl" else "put", message)
        return results, sent

    def _dropped(self, n: int, err: StoreError) -> list[ItemResult]:
        over_quota = err.is_refusal(Problem.QUOTA)
        self._failures.record("quota" if over_quota else "put", err)
        return [ItemResult(ItemStatus.DROPPED, Reason.QUOTA if over_quota else Reason.UNAVAILABLE)] * n


__all__ = ["Buffer", "DataPath", "NodeCalls", "as_view", "batches", "nixl_installed", "nixl_refused", "results_of"]
