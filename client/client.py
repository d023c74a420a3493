"""The async client engines embed: hash, look up, read into their buffers, offer and save.

The store is best effort toward the engine. Every public method here returns
a typed result and never raises because of the store: a connection error,
timeout, 4xx/5xx answer, malformed frame or checksum mismatch becomes a miss
(lookups, reads) or a dropped save, counted in :attr:`PrefixClient.failures`
and logged at most once per ``warn_interval_s`` per operation.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import aiohttp
import aiohttp.payload
import numpy as np

from ..protocol.keys import Kind
from ..protocol.namespace import Namespace
from ..protocol.wire import (
    CONTENT_TYPE,
    HAVE,
    REASON_QUOTA,
    STATUS_HAVE,
    STATUS_OK,
    WANT,
    GetItem,
    ItemResult,
    ItemSpec,
    LookupAnswer,
    LookupRequest,
    WireError,
    decode_frame,
    encode_header,
)
from .bulk import BulkError, BulkPool, post_control, read_get
from .config import ClientConfig
from .device import DeviceBuffer
from .nixl_path import Described, Dest, LookupRuns, NixlChannel, NixlPath, NixlUnavailable, TransferFailed, fetch_metadata
from .prompt import Prompt, with_payload
from .results import LookupResult, SaveResult

log = logging.getLogger(__name__)

Buffer = bytearray | memoryview | np.ndarray
"""A writable buffer the client fills (bytearray, memoryview, numpy array)."""


class StoreUnavailable(Exception):
    """Internal: the store could not answer; public methods turn it into a miss."""


class _FramePayload(aiohttp.payload.Payload):
    """A request body of a header plus payload views, sent without joining them."""

    def __init__(self, parts: Sequence[bytes | memoryview]) -> None:
        super().__init__(parts, content_type=CONTENT_TYPE)
        self._parts = parts
        self._size = sum(len(p) for p in parts)

    def decode(self, encoding: str = "utf-8", errors: str = "strict") -> str:
        raise TypeError("a binary frame has no text form")

    async def write(self, writer: Any) -> None:
        for part in self._parts:
            await writer.write(part)

    async def write_with_length(self, writer: Any, content_length: int | None) -> None:
        await self.write(writer)


def _batches(sizes: list[int], max_bytes: int, max_items: int) -> list[list[int]]:
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


def _view(buf: Buffer) -> memoryview:
    if isinstance(buf, np.ndarray):
        if not buf.flags.c_contiguous:
            raise ValueError("output buffers must be C-contiguous")
        return buf.reshape(-1).view(np.uint8).data.cast("B")
    return memoryview(buf).cast("B")


class PrefixClient:
    def __new__(cls, namespace: Namespace, config: ClientConfig | None = None) -> PrefixClient:
        # A config with cluster seed URLs makes a cluster client (client/cluster.py): same methods and
        # results, so an engine moves from one node to a cluster by configuration alone.
        if cls is PrefixClient and config is not None and config.urls:
            from .cluster import ClusterClient

            return super().__new__(ClusterClient)
        return super().__new__(cls)

    def __init__(self, namespace: Namespace, config: ClientConfig | None = None) -> None:
        self.namespace = namespace
        self.config = config or ClientConfig()
        self._session: aiohttp.ClientSession | None = None  # control calls
        self._pool: BulkPool | None = None  # /v1/get bodies (client/bulk.py)
        self._registered = False
        self.failures: collections.Counter[str] = collections.Counter()
        self._last_warning: dict[str, float] = {}
        # Data path (ClientConfig.data_path): NIXL when it works, HTTP otherwise (client/nixl_path.py).
        self.path_bytes: collections.Counter[str] = collections.Counter()
        """Payload bytes moved, by path ('nixl', 'http'): which path the data actually took."""
        self._nixl: NixlChannel | None = None
        self._nixl_off: str | None = None  # why NIXL is not used (None: not decided, or in use)
        self._nixl_retry_s = 0.0  # after a transient failure, when to try NIXL again
        self._path_logged: str | None = None
        self._pending_buffers: list[Dest] = []  # registered once an agent exists
        self._described = LookupRuns()  # payloads recent lookups placed in the store's arena (NIXL)

    async def __aenter__(self) -> PrefixClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._nixl is not None:
            self._nixl.path.close()
            self._nixl = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            timeout = aiohttp.ClientTimeout(total=self.config.timeout_s, sock_connect=self.config.connect_timeout_s)
            auth = self.config.authorization
            context = self.config.ssl_context()
            self._session = aiohttp.ClientSession(
                base_url=self.config.url, timeout=timeout,
                headers={"Authorization": auth} if auth else None,
                connector=aiohttp.TCPConnector(limit=64, enable_cleanup_closed=True,
                                               ssl=context if context is not None else True),
                auto_decompress=False)
        return self._session

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return Prompt(self.namespace, tokens, extra_keys)

    # ------------------------------------------------------------ plumbing

    def _fail(self, op: str, err: BaseException) -> None:
        self.failures[op] += 1
        now = time.monotonic()
        if now - self._last_warning.get(op, -1e18) >= self.config.warn_interval_s:
            self._last_warning[op] = now
            log.warning("prefixstore %s failed (%d so far), treated as a miss: %s", op, self.failures[op], err)

    async def _post(self, path: str, header: dict[str, object],
                    payloads: Sequence[bytes | memoryview] = ()) -> dict[str, object]:
        """POST a frame, return the answer's header. Raises StoreUnavailable.

        Frames without payloads (lookup, offer, commit, release, register) go
        over the pooled raw connections of the bulk path; puts, whose payload
        views aiohttp streams without joining them, over aiohttp."""
        if not payloads:
            try:
                raw = await post_control(self._bulk(), path, encode_header(header), timeout_s=self.config.timeout_s)
                answer, _ = decode_frame(raw)
                return answer
            except (BulkError, asyncio.TimeoutError, OSError, WireError) as err:
                status = f" answered {err.status}" if isinstance(err, BulkError) and err.status else ""
                raise StoreUnavailable(f"{path}{status}: {type(err).__name__}: {err}") from err
        body = _FramePayload([encode_header(header), *payloads])
        try:
            async with self._http().post(path, data=body) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise StoreUnavailable(f"{path} answered {resp.status}: {raw[:300].decode(errors='replace')}")
            answer, _ = decode_frame(raw)
            return answer
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError, WireError) as err:
            raise StoreUnavailable(f"{path}: {type(err).__name__}: {err}") from err

    async def _ensure_namespace(self) -> None:
        if not self._registered:
            answer = await self._post("/v1/namespaces", {"namespace": self.namespace.to_wire()})
            if answer.get("ns") != self.namespace.id:
                raise StoreUnavailable("the store registered a different namespace id (version skew?)")
            self._registered = True

    async def _call(self, path: str, header: dict[str, object],
                    payloads: Sequence[bytes | memoryview] = ()) -> dict[str, object]:
        """A namespaced call; registers the namespace first and again if the store forgot it."""
        await self._ensure_namespace()
        try:
            return await self._post(path, header, payloads)
        except StoreUnavailable as err:
            if "answered 404" not in str(err):
                raise
            self._registered = False
            await self._ensure_namespace()
            return await self._post(path, header, payloads)

    # ------------------------------------------------------------ data path

    @property
    def data_path(self) -> str:
        """'nixl' or 'http': the path payloads take now ('undecided' before the first transfer)."""
        if self._nixl is not None and self._nixl.path.remote is not None:
            return "nixl"
        if self.config.data_path == "http" or self._nixl_off is not None:
            return "http"
        return "undecided"

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a buffer the client will read into or send from (a staging region) with the
        NIXL agent, once, so transfers into it need no per-call registration. True when the NIXL
        path will use it; a no-op (False) on the HTTP path. The buffer must outlive the client or
        be passed to :meth:`unregister_buffer`. A :class:`DeviceBuffer` (GPU memory) is
        registered as such, for :meth:`read_device`."""
        if self.config.data_path == "http":
            return False
        view = buf if isinstance(buf, DeviceBuffer) else _view(buf)
        if self._nixl is None:
            self._pending_buffers.append(view)
            return True
        return self._nixl.path.register(view) or True

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        view = buf if isinstance(buf, DeviceBuffer) else _view(buf)
        self._pending_buffers = [v for v in self._pending_buffers if v is not view]
        return self._nixl.path.unregister(view) if self._nixl is not None else False

    def _use_path(self, path: str, why: str) -> None:
        """One log line when the data path is decided or changes."""
        if self._path_logged != path:
            self._path_logged = path
            log.info("prefixstore data path: %s (%s)", path, why)

    def _nixl_disable(self, reason: str, permanent: bool) -> None:
        if self.config.data_path == "nixl":
            self._fail("nixl", StoreUnavailable(f"NIXL data path unavailable, using HTTP: {reason}"))
        if permanent:
            self._nixl_off = reason
        else:
            self._nixl_retry_s = time.monotonic() + self.config.warn_interval_s
        self._use_path("http", reason)

    async def _nixl_ready(self) -> NixlChannel | None:
        """The NIXL channel when the NIXL path is usable now, else None (use HTTP)."""
        if self.config.data_path == "http" or self._nixl_off is not None:
            if self.config.data_path == "http":
                self._use_path("http", "data_path = http")
            return None
        if self._nixl is not None and self._nixl.path.remote is not None:
            return self._nixl
        if time.monotonic() < self._nixl_retry_s:
            return None
        if self._nixl is None and not _nixl_installed():
            self._nixl_disable("nixl is not installed here (pip install nixl)", permanent=True)
            return None
        try:
            gen: list[int] = []
            agent, metadata = await fetch_metadata(self._post, gen)  # before making an agent: is NIXL served?
            if self._nixl is None:
                try:
                    path = NixlPath()
                except NixlUnavailable as err:
                    self._nixl_disable(str(err), permanent=True)
                    return None
                self._nixl = NixlChannel(path)
                for view in self._pending_buffers:
                    path.register(view)
                self._pending_buffers = []
            self._nixl.path.connect(agent, metadata, gen[0] if gen else None)
        except StoreUnavailable as err:
            refused = _nixl_refused(err)
            self._nixl_disable(f"the store does not serve NIXL: {err}" if refused
                               else f"cannot ask the store for its NIXL agent: {err}", permanent=refused)
            return None
        except (TransferFailed, WireError) as err:
            self._nixl_disable(f"cannot load the store's NIXL agent: {err}", permanent=False)
            return None
        self._use_path("nixl", f"store agent {self._nixl.path.remote}")
        return self._nixl

    def _nixl_problems(self, problems: Sequence[tuple[str, str]]) -> None:
        for kind, message in problems:
            if kind == "checksum":
                self.failures["checksum"] += 1
            self._fail("nixl" if kind == "nixl" else "read", StoreUnavailable(message))

    # ------------------------------------------------------------ lookup

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """One round trip: the reusable KV and state lengths, and a lease on them."""
        p = prompt if isinstance(prompt, Prompt) else self.prompt(prompt)
        leased = self.config.lease if lease is None else lease
        # On the NIXL path the answer also places the matched payloads (store/nixl_lookup.py):
        # reads of them then go straight to one READ, without /v1/nixl/get.
        on_nixl = leased and self._on_nixl()
        req = LookupRequest(namespace_id=self.namespace.id, hashes=b"".join(p.hashes), tokens=p.packed,
                            lease=leased, extras=tuple((j, x) for j, x in enumerate(p.extra_keys) if x),
                            nixl=on_nixl)
        sent_at = time.monotonic()
        try:
            answer = LookupAnswer.from_header(await self._call("/v1/lookup", req.to_header()))
        except (StoreUnavailable, WireError) as err:
            self._fail("lookup", err)
            return LookupResult(prompt=p, ok=False)
        if answer.nixl is not None and answer.lease_id is not None:
            self._described.add(answer.nixl, answer.lease_id, sent_at)
        return LookupResult(prompt=p, kv_tokens=answer.kv_tokens, state_tokens=answer.state_tokens,
                            checkpoint_hint=answer.checkpoint_hint, matched_blocks=answer.matched_blocks,
                            child=answer.child, snapshot=answer.snapshot, lease_id=answer.lease_id)

    def _on_nixl(self) -> bool:
        """This client's agent is connected to the store's: answers may place payloads for it."""
        return self._nixl is not None and self._nixl.path.remote is not None

    async def release(self, lease_id: bytes | None) -> bool:
        if lease_id is None:
            return False
        self._described.forget_lease(lease_id)  # before: its runs must not be READ once it may end
        try:
            answer = await self._call("/v1/release", {"lease": lease_id})
        except StoreUnavailable as err:
            self._fail("release", err)
            return False
        return bool(answer.get("released"))

    # ------------------------------------------------------------ read

    async def read(self, items: Sequence[GetItem], outs: Sequence[Buffer]) -> list[int]:
        """Read payloads into caller buffers. Per item: bytes written, or -1 for a miss.

        A buffer may be larger than its payload; only the first bytes are
        written. Only payloads received whole with a matching checksum count:
        when a batch fails part-way (connection lost, timeout, malformed
        answer), the payloads already verified keep their sizes and the rest
        are -1, although their buffers may have been partly written."""
        if len(items) != len(outs):
            raise ValueError("read: one output buffer per item")
        views = [_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("read: output buffers must be writable")
        done: list[int] = [-1] * len(items)
        for batch in _batches([v.nbytes for v in views], self.config.max_get_bytes, self.config.max_items):
            await self._read_batch(items, views, batch, done)
        return done

    @property
    def reads_device(self) -> bool:
        """Whether GPU staging should READ into device memory: ``device_reads`` is on and NIXL is
        not ruled out (configured off, or found unusable for good). When False callers go straight
        to host reads; :meth:`read_device` itself works whenever NIXL does."""
        return self.config.device_reads and self._nixl_usable()

    def _nixl_usable(self) -> bool:
        return self.config.data_path != "http" and self._nixl_off is None

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]:
        """READ payloads over NIXL straight into device memory (a GPU staging region).

        Only with ``verify_checksums=False`` (an operator's choice to trust leases: GPU memory
        cannot be hashed here). Per item: bytes written and proven, or -1 for anything not delivered -- a miss, a failed
        or unproven transfer, a payload the store serves over HTTP only, or no NIXL path at all
        (the HTTP path cannot write device memory). Read the -1 items again with :meth:`read`
        into host memory to tell a miss from those. The bytes of a -1 item's buffer are
        undefined: zero them before anything else reads them (client/device.py says why, and
        how delivered bytes are proven without hashing them)."""
        if len(items) != len(outs):
            raise ValueError("read_device: one output buffer per item")
        if not all(isinstance(o, DeviceBuffer) for o in outs):
            raise TypeError("read_device: outputs must be DeviceBuffer (DeviceBuffer.of(tensor))")
        if self.config.verify_checksums:
            raise ValueError("read_device: the client cannot check GPU memory against xxh3 (DESIGN: every "
                             "crossing verified); set verify_checksums=False to trust leases instead")
        done: list[int] = [-1] * len(items)
        for batch in _batches([o.nbytes for o in outs], self.config.max_get_bytes, self.config.max_items):
            await self._read_device_batch(items, outs, batch, done)
        return done

    async def _read_device_batch(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer], batch: list[int],
                                 done: list[int]) -> None:
        channel = await self._nixl_ready() if self._nixl_usable() else None
        if channel is None:
            return
        if len(self._described):
            batch = await self._read_described(channel, items, outs, batch, done)
            if not batch:
                return
        try:
            got = await channel.read(self._call, self.namespace.id, [items[i] for i in batch],
                                     [outs[i] for i in batch], self.config.verify_checksums, self.config.timeout_s)
        except StoreUnavailable as err:
            if _nixl_refused(err):
                self._nixl_disable(f"the store stopped serving NIXL: {err}", permanent=True)
            else:
                self._fail("read", err)
            return
        for i, size in zip(batch, got.sizes):
            done[i] = size
        self.path_bytes["nixl"] += got.nixl_bytes
        self._nixl_problems(got.problems)
        if any(kind == "nixl" for kind, _ in got.problems):
            self._use_path("http", "a NIXL transfer failed; HTTP until the agent is reloaded")

    def _bulk(self) -> BulkPool:
        if self._pool is None or self._pool.closed:
            # The same verifying context as the control calls (ClientConfig.ssl_context).
            self._pool = BulkPool(self.config.url, connect_timeout_s=self.config.connect_timeout_s,
                                  ssl_context=self.config.ssl_context(), authorization=self.config.authorization)
        return self._pool

    async def _read_batch(self, items: Sequence[GetItem], views: list[memoryview], batch: list[int],
                          done: list[int]) -> None:
        """NIXL when it is usable (one READ for the batch), HTTP for everything it did not deliver
        and could not prove missing."""
        channel = await self._nixl_ready()
        if channel is not None and len(self._described):
            batch = await self._read_described(channel, items, views, batch, done)
            if not batch:
                return
        if channel is not None:
            try:
                got = await channel.read(self._call, self.namespace.id, [items[i] for i in batch],
                                         [views[i] for i in batch], self.config.verify_checksums, self.config.timeout_s)
            except StoreUnavailable as err:
                if not _nixl_refused(err):
                    self._fail("read", err)
                    return
                self._nixl_disable(f"the store stopped serving NIXL: {err}", permanent=True)
            else:
                for i, size in zip(batch, got.sizes):
                    done[i] = size
                self.path_bytes["nixl"] += got.nixl_bytes
                self._nixl_problems(got.problems)
                if any(kind == "nixl" for kind, _ in got.problems):
                    self._use_path("http", "a NIXL transfer failed; HTTP until the agent is reloaded")
                batch = [batch[j] for j in got.http]
                if not batch:
                    return
        await self._http_read_batch(items, views, batch, done)

    async def _read_described(self, channel: NixlChannel, items: Sequence[GetItem], views: Sequence[Dest],
                              batch: list[int], done: list[int]) -> list[int]:
        """READ the batch's payloads that a recent lookup placed (no /v1/nixl/get); returns the
        items left for the usual path."""
        now = time.monotonic()
        ns = self.namespace
        token_bytes = ns.kv.token_bytes
        found: list[tuple[Described, int, int]] = []
        which: list[int] = []
        rest: list[int] = []
        for i in batch:
            item = items[i]
            d = self._described.get(item.key, now)
            if d is None:
                rest.append(i)
                continue
            if item.layer_start == 0 and item.layer_end is None:
                offset, length = 0, d.size
            elif self.config.verify_checksums:
                # The store keeps one xxh3 per payload: a layer range is checked only when the store
                # hashes it for /v1/nixl/get. Unchecked bytes only where the operator turned checks off.
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
            found.append((d, offset, length))
            which.append(i)
        if not found:
            return batch
        got = await channel.read_described([views[i] for i in which], found, self.config.verify_checksums,
                                           self.config.timeout_s)
        for i, size in zip(which, got.sizes):
            done[i] = size
        self.path_bytes["nixl"] += got.nixl_bytes
        self._nixl_problems(got.problems)
        if any(kind == "nixl" for kind, _ in got.problems):
            self._described.clear()  # the agent is reloaded: its runs may name another incarnation
        return sorted(rest + [which[j] for j in got.http])

    async def _http_read_batch(self, items: Sequence[GetItem], views: list[memoryview], batch: list[int],
                               done: list[int]) -> None:
        """One POST /v1/get on the bulk path (client/bulk.py): payloads land straight in ``views``."""
        request = encode_header({"ns": self.namespace.id, "items": [items[i].to_wire() for i in batch]})
        batch_views = [views[i] for i in batch]
        try:
            await self._ensure_namespace()
        except StoreUnavailable as err:
            self._fail("read", err)
            return
        result = await read_get(self._bulk(), request, batch_views, timeout_s=self.config.timeout_s,
                                verify=self.config.verify_checksums)
        if result.error is not None and result.error.status == 404:
            # The store forgot the namespace (a restart): register again and retry once.
            self._registered = False
            try:
                await self._ensure_namespace()
            except StoreUnavailable as err:
                self._fail("read", err)
                return
            result = await read_get(self._bulk(), request, batch_views, timeout_s=self.config.timeout_s,
                                    verify=self.config.verify_checksums)
        # Only payloads received whole and verified have a size here; anything
        # partially written by a failed exchange stays -1.
        for i, size in zip(batch, result.sizes):
            done[i] = size
        self.path_bytes["http"] += sum(size for size in result.sizes if size > 0)
        for kind, message in result.problems:
            if kind == "checksum":
                self.failures["checksum"] += 1
            self._fail("read", StoreUnavailable(message))
        if result.error is not None:
            self._fail("read", result.error)

    # ------------------------------------------------------------ write

    async def offer(self, items: Sequence[ItemSpec]) -> list[ItemResult]:
        """want / have / rejected per item; a store failure answers 'rejected' for all."""
        out: list[ItemResult] = []
        for s in range(0, len(items), self.config.max_items):
            chunk = items[s : s + self.config.max_items]
            try:
                answer = await self._call("/v1/offer", {"ns": self.namespace.id, "items": [i.to_wire() for i in chunk]})
                out.extend(_results(answer, len(chunk)))
            except (StoreUnavailable, WireError) as err:
                self._fail("offer", err)
                out.extend(ItemResult("rejected", "store unavailable") for _ in chunk)
        return out

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        """Send payloads (checksummed here) and commit them. Failures drop the save."""
        out: list[ItemResult] = []
        for s in range(0, len(items), self.config.max_items):
            chunk = items[s : s + self.config.max_items]
            views = [_view(buf) for _, buf in chunk]
            specs = [with_payload(spec, v) for (spec, _), v in zip(chunk, views)]
            channel = await self._nixl_ready()
            if channel is not None:
                try:
                    results, problems, written = await channel.write(self._call, self.namespace.id, specs, views,
                                                                     commit, self.config.timeout_s)
                except StoreUnavailable as err:
                    if _nixl_refused(err):
                        self._nixl_disable(f"the store stopped serving NIXL: {err}", permanent=True)
                    else:
                        over_quota = "answered 413" in str(err) and "quota" in str(err)
                        self._fail("quota" if over_quota else "put", err)
                        out.extend(ItemResult("dropped", REASON_QUOTA if over_quota else "store unavailable")
                                   for _ in chunk)
                        continue
                except (TransferFailed, WireError) as err:
                    self._fail("put", err)
                    out.extend(ItemResult("dropped", "store unavailable") for _ in chunk)
                    continue
                else:
                    out.extend(results)
                    self.path_bytes["nixl"] += written
                    self._nixl_problems(problems)
                    continue
            try:
                answer = await self._call("/v1/put", {"ns": self.namespace.id, "commit": commit,
                                                      "items": [x.to_wire() for x in specs]}, views)
                results = _results(answer, len(chunk))
                out.extend(results)
                self.path_bytes["http"] += sum(v.nbytes for v, r in zip(views, results) if r.status == STATUS_OK)
                refused = sum(r.reason == REASON_QUOTA for r in results)
                if refused:  # never a silent drop: counted and warned like a failure
                    self._fail("quota", StoreUnavailable(f"{refused} item(s) refused: {REASON_QUOTA}"))
            except (StoreUnavailable, WireError) as err:
                over_quota = "answered 413" in str(err) and "quota" in str(err)
                self._fail("quota" if over_quota else "put", err)
                out.extend(ItemResult("dropped", REASON_QUOTA if over_quota else "store unavailable") for _ in chunk)
        return out

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0) -> SaveResult:
        """Offer KV [start, kv_upto) and snapshots, then put what the store wants.

        ``kv_payload(a, b)`` returns the store-layout payload of tokens [a, b)
        (layer-major, see KVLayout); it is only called for wanted items.
        ``snapshots`` maps boundaries t <= kv_upto to state payloads.

        Items go batch by batch (``max_items``): offer batch k, put what it
        wants, then offer batch k+1. Offering everything first fails past one
        batch: the store rejects a block whose parent was offered but not yet
        stored ("parent not stored"), and every block after it chains off it.
        Once a batch is dropped because the store is unavailable, the rest are
        dropped without asking (their parents are missing anyway)."""
        kv = prompt.kv_items(kv_upto, start - start % prompt.block_tokens)
        specs = [spec for spec, _, _ in kv]
        for t in sorted(snapshots or {}):
            specs.append(prompt.state_item(t, kv_upto))
        stored = have = dropped = 0
        saved: list[tuple[Kind, ItemResult]] = []
        for s in range(0, len(specs), self.config.max_items):
            chunk = specs[s : s + self.config.max_items]
            if dropped:
                dropped += len(chunk)
                continue
            decisions = await self.offer(chunk)
            wanted: list[tuple[ItemSpec, Buffer]] = []
            for n, (spec, d) in enumerate(zip(chunk, decisions), start=s):
                if d.status != WANT:
                    continue
                if n < len(kv):
                    _, a, b = kv[n]
                    wanted.append((spec, kv_payload(a, b)))
                else:
                    wanted.append((spec, (snapshots or {})[spec.boundary]))
            results = await self.put(wanted) if wanted else []
            stored += sum(r.status == STATUS_OK for r in results)
            dropped += sum(r.status == "dropped" for r in results) + sum(d.reason == "store unavailable"
                                                                           for d in decisions)
            have += sum(d.status == HAVE for d in decisions) + sum(r.status == STATUS_HAVE for r in results)
            saved.extend((w.kind, r) for (w, _), r in zip(wanted, results))
        rejected = len(specs) - stored - have - dropped
        return SaveResult(stored=stored, already=have, rejected=rejected, dropped=dropped, results=saved)


def _nixl_installed() -> bool:
    """Whether the nixl package exists here, without importing it (seconds with torch installed)."""
    try:
        return importlib.util.find_spec("nixl") is not None
    except (ImportError, ValueError):  # ValueError: a module hidden by sys.modules["nixl"] = None
        return False


def _nixl_refused(err: StoreUnavailable) -> bool:
    """The store answered that it does not serve NIXL (404 naming the field 'nixl')."""
    text = str(err)
    return "answered 404" in text and '"field": "nixl"' in text


def _results(answer: dict[str, object], n: int) -> list[ItemResult]:
    raw = answer.get("results")
    if not isinstance(raw, list) or len(raw) != n:
        raise WireError("results", f"expected {n} results")
    return [ItemResult.from_wire(r) for r in raw]


__all__ = ["Buffer", "Kind", "PrefixClient"]
