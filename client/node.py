"""The client of one store node: hash, look up, read into the engine's buffers, offer and save.

The store is best effort toward the engine. Every engine-facing method here returns a typed
result and never raises because of the store: a connection error, timeout, 4xx/5xx answer,
malformed frame or checksum mismatch becomes a miss (lookups, reads) or a dropped save, counted
in :attr:`NodeClient.failures` and warned about at most once per ``warn_interval_s``.

Every call goes over one frame transport (transport/frames.py: pooled HTTP/1.1 connections,
payloads straight between the wire and the caller's buffers); payloads take the data path
(client/datapath.py: NIXL when usable, HTTP otherwise). A call on the namespace registers it
first, and once more when the store answers that it does not know it (a restart).

The cluster client (client/cluster.py) composes node clients; it uses the node calls that raise
(:meth:`probe`, :meth:`report`, :meth:`members`) and counts their failures per node.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from typing import Protocol, TypeVar

import numpy as np
from prefixstore.protocol.errors import ItemStatus, Problem, Reason, StoreError
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.match import lean_levels, span_tokens
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.probe import LookupReport, ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import (
    GetItem,
    ItemResult,
    ItemSpec,
    LookupAnswer,
    LookupRequest,
    WireError,
)
from prefixstore.transport.frames import FramePool, get_json, post

from .config import ClientConfig
from .control import ControlChannel
from .datapath import Buffer, DataPath, as_view, batches, results_of
from .device import DeviceBuffer
from .failures import Failures
from .prompt import Prompt, with_payloads
from .results import LookupResult, SaveResult, lost, tally
from .saves import SaveItem, save_items

Observer = Callable[[str, dict[str, object], dict[str, object]], Awaitable[None]]
"""``(path, request header, answer header)``, awaited after each answered call, before the client
acts on the answer: a documented seam for tests and diagnostics (e.g. run something between
/v1/nixl/get and the READ it feeds)."""


MAX_LEAN_TRIES = 3
"""Lean lookups (and probes) asked before one that carries the whole prompt (each further try
carries the levels the store named before: only a write racing the lookup makes a second one need
another)."""


LeanAsk = TypeVar("LeanAsk", LookupRequest, ProbeRequest)
"""A request :meth:`NodeClient.ask_lean` can send lean."""


class LeanAnswer(Protocol):
    @property
    def need_level(self) -> int | None: ...


Answered = TypeVar("Answered", bound=LeanAnswer)


class NodeClient:
    def __init__(self, namespace: Namespace, config: ClientConfig | None = None, label: str = "prefixstore") -> None:
        self.namespace = namespace
        self.config = config or ClientConfig()
        self._pool: FramePool | None = None
        self._control: ControlChannel | None = None
        self._registered = False
        self._failures = Failures(self.config.warn_interval_s, label)
        self.data = DataPath(namespace, self.config, self, self._failures)
        self.observers: list[Observer] = []

    @property
    def url(self) -> str:
        return self.config.url

    @property
    def failures(self) -> collections.Counter[str]:
        """Store failures by operation, each a miss or a dropped save (client/failures.py)."""
        return self._failures.counts

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved, by data path ('nixl', 'http')."""
        return self.data.bytes_moved

    @property
    def data_path(self) -> str:
        """'nixl' or 'http': the path payloads take now ('undecided' before the first transfer)."""
        return self.data.name

    @property
    def reads_device(self) -> bool:
        """Whether GPU staging should READ into device memory: ``device_reads`` is on and NIXL is
        not ruled out. When False callers go straight to host reads; :meth:`read_device` itself
        works whenever NIXL does."""
        return self.config.device_reads and self.data.nixl_possible

    async def __aenter__(self) -> NodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        self.data.close()
        if self._control is not None:
            await self._control.close()
            self._control = None
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def prompt(self, tokens: Sequence[int] | np.ndarray | bytes, extra_keys: Sequence[bytes] | None = None) -> Prompt:
        return Prompt(self.namespace, tokens, extra_keys)

    # ------------------------------------------------------------ calls (NodeCalls, client/datapath.py)

    @property
    def pool(self) -> FramePool:
        """The frame transport's connection pool to this node (a documented seam: connection counts)."""
        if self._pool is None or self._pool.closed:
            # One verifying TLS context for every call (ClientConfig.ssl_context).
            self._pool = FramePool(self.config.url, connect_timeout_s=self.config.connect_timeout_s,
                                   ssl_context=self.config.ssl_context(), authorization=self.config.authorization)
        return self._pool

    @property
    def control(self) -> ControlChannel | None:
        """The control channel to this node (client/control.py), where ``control_channel`` is on."""
        if not self.config.control_channel:
            return None
        pool = self.pool
        if self._control is None or self._control.pool is not pool:
            if self._control is not None:  # its pool was closed and replaced
                asyncio.ensure_future(self._control.close())
            self._control = ControlChannel(pool, timeout_s=self.config.timeout_s)
        return self._control

    async def post(self, path: str, header: dict[str, object],
                   payloads: Sequence[bytes | memoryview] = ()) -> dict[str, object]:
        """POST a frame, return the answer's header. Raises StoreError. A lookup or a probe goes over
        the control channel where it is open (the same frames, the same answers)."""
        control = self.control if not payloads else None
        answer = await control.call(path, header) if control is not None else None
        if answer is None:
            answer = await post(self.pool, path, header, payloads, timeout_s=self.config.timeout_s)
        for observe in self.observers:
            await observe(path, header, answer)
        return answer

    async def ensure_namespace(self) -> None:
        if not self._registered:
            answer = await self.post("/v1/namespaces", {"namespace": self.namespace.to_wire()})
            if answer.get("ns") != self.namespace.id:
                raise StoreError("/v1/namespaces", "the store registered a different namespace id (version skew?)",
                                 problem=Problem.INTERNAL)
            self._registered = True

    def forget_namespace(self) -> None:
        self._registered = False

    async def call(self, path: str, header: dict[str, object],
                   payloads: Sequence[bytes | memoryview] = ()) -> dict[str, object]:
        """A call on the namespace: registers it first, and again if the store forgot it."""
        await self.ensure_namespace()
        try:
            return await self.post(path, header, payloads)
        except StoreError as err:
            if not err.is_refusal(Problem.UNKNOWN, "ns"):
                raise
            self._registered = False
            await self.ensure_namespace()
            return await self.post(path, header, payloads)

    # ------------------------------------------------------------ node calls for the cluster (raise StoreError)

    async def probe(self, req: ProbeRequest, lease: bool) -> ProbeAnswer:
        """This node's answer for some levels of a prompt (DESIGN §8), asked lean as a lookup is
        (:meth:`ask_lean`); placed payloads are remembered."""
        req = dataclasses.replace(req, lease=lease, nixl=lease and self.data.connected)
        started = time.monotonic()
        try:
            answer = await self.ask_lean("/v1/probe", req, req.num_tokens, req.start, ProbeAnswer.from_header)
        except WireError as err:
            raise StoreError("/v1/probe", str(err), problem=Problem.UNAVAILABLE) from err
        if answer.nixl is not None and answer.lease_id is not None:
            self.data.place(answer.nixl, answer.lease_id, started)
        return answer

    async def report(self, report: LookupReport) -> None:
        await self.call("/v1/lookup_report", report.to_header())

    async def members(self) -> Mapping[str, object]:
        """``GET /v1/members``: the member list this node serves."""
        body = await get_json(self.pool, "/v1/members", timeout_s=self.config.timeout_s)
        if not isinstance(body, dict):
            raise StoreError("/v1/members", "expected a JSON object", problem=Problem.UNAVAILABLE)
        return body

    async def ask_lean(self, path: str, req: LeanAsk, num_tokens: int, start: int,
                       parse: Callable[[dict[str, object]], Answered]) -> Answered:
        """``req`` (a lookup, or a probe of the levels from ``start``, carrying every token of its
        ``num_tokens``) asked lean first (protocol/match.py ``lean_levels``): the tokens of its first
        level and of the last ``lookup_token_window`` tokens. A store that needs another level
        names it (``need_level``, absolute); ask again with it. A write landing between the two may
        move the stop again, hence a few tries, then the whole request, which is always answered.
        ``lookup_token_window=None``: the whole request at once."""
        window = self.config.lookup_token_window
        B = self.namespace.block_tokens
        levels = -(-num_tokens // B)
        needed: list[int] = []
        for _ in range(MAX_LEAN_TRIES if window is not None else 0):
            spans = lean_levels(levels, B, window or 0, needed)
            if spans == ((0, levels),):  # a short request: whole
                break
            answer = parse(await self.call(path, req.lean_header(span_tokens(req.tokens, B, spans), spans, num_tokens)))
            if answer.need_level is None:
                return answer
            needed.append(answer.need_level - start)
        return parse(await self.call(path, req.to_header()))

    # ------------------------------------------------------------ lookup

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        """One round trip: the reusable KV and state lengths, and a lease on them."""
        p = prompt if isinstance(prompt, Prompt) else self.prompt(prompt)
        leased = self.config.lease if lease is None else lease
        # On the NIXL path the answer also places the matched payloads (store/nixl_lookup.py):
        # reads of them then go straight to one READ, without /v1/nixl/get.
        req = LookupRequest(namespace_id=self.namespace.id, hashes=p.hash_bytes, tokens=p.packed,
                            lease=leased, extras=tuple((j, x) for j, x in enumerate(p.extra_keys) if x),
                            nixl=leased and self.data.connected)
        sent_at = time.monotonic()
        try:
            answer = await self.ask_lean("/v1/lookup", req, p.num_tokens, 0, LookupAnswer.from_header)
        except (StoreError, WireError) as err:
            self._failures.record("lookup", err)
            return LookupResult(prompt=p, ok=False)
        if answer.nixl is not None and answer.lease_id is not None:
            self.data.place(answer.nixl, answer.lease_id, sent_at)
        return LookupResult(prompt=p, kv_tokens=answer.kv_tokens, state_tokens=answer.state_tokens,
                            checkpoint_hint=answer.checkpoint_hint, matched_blocks=answer.matched_blocks,
                            child=answer.child, snapshot=answer.snapshot, lease_id=answer.lease_id)

    async def release(self, lease_id: bytes | None) -> bool:
        if lease_id is None:
            return False
        self.data.forget_lease(lease_id)
        try:
            answer = await self.call("/v1/release", {"lease": lease_id})
        except StoreError as err:
            self._failures.record("release", err)
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
        views = [as_view(o) for o in outs]
        if any(v.readonly for v in views):
            raise ValueError("read: output buffers must be writable")
        done: list[int] = [-1] * len(items)
        for batch in batches([v.nbytes for v in views], self.config.max_get_bytes, self.config.max_items):
            await self.data.read(items, views, batch, done)
        return done

    async def read_device(self, items: Sequence[GetItem], outs: Sequence[DeviceBuffer]) -> list[int]:
        """READ payloads over NIXL straight into device memory (a GPU staging region).

        Only with ``verify_checksums=False`` (an operator's choice to trust leases: GPU memory
        cannot be hashed here). Per item: bytes written and proven, or -1 for anything not
        delivered -- a miss, a failed or unproven transfer, a payload the store serves over HTTP
        only, or no NIXL path at all (the HTTP path cannot write device memory). Read the -1 items
        again with :meth:`read` into host memory to tell a miss from those. The bytes of a -1
        item's buffer are undefined: zero them before anything else reads them (client/device.py)."""
        check_device_outs(items, outs, self.config)
        done: list[int] = [-1] * len(items)
        for batch in batches([o.nbytes for o in outs], self.config.max_get_bytes, self.config.max_items):
            await self.data.read_device(items, outs, batch, done)
        return done

    def register_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        """Register a buffer the client will read into or send from (a staging region) with the
        NIXL agent, once, so transfers into it need no per-call registration. True when the NIXL
        path will use it; a no-op (False) on the HTTP path. The buffer must outlive the client or
        be passed to :meth:`unregister_buffer`. A :class:`DeviceBuffer` (GPU memory) is
        registered as such, for :meth:`read_device`."""
        return self.data.register(buf)

    def unregister_buffer(self, buf: Buffer | DeviceBuffer) -> bool:
        return self.data.unregister(buf)

    # ------------------------------------------------------------ write

    async def offer(self, items: Sequence[ItemSpec], place: bool = True) -> list[ItemResult]:
        """want / have / rejected per item; a store failure answers 'rejected' for all. ``place``
        (a cluster, protocol/placement.py): let the node decide fork heads (a cluster save does)."""
        out: list[ItemResult] = []
        for s, e in item_chunks(items, self.config.max_items):
            chunk = items[s:e]
            header: dict[str, object] = {"ns": self.namespace.id, "items": [i.to_wire() for i in chunk]}
            if not place:
                header["place"] = False
            try:
                answer = await self.call("/v1/offer", header)
                out.extend(results_of(answer, len(chunk)))
            except (StoreError, WireError) as err:
                self._failures.record("offer", err)
                out.extend(ItemResult(ItemStatus.REJECTED, Reason.UNAVAILABLE) for _ in chunk)
        return out

    async def put(self, items: Sequence[tuple[ItemSpec, Buffer]], commit: bool = True) -> list[ItemResult]:
        """Send payloads (checksummed here) and commit them. Failures drop the save."""
        out: list[ItemResult] = []
        if items and all(spec.record for spec, _ in items):
            # Fork records (a cluster save, protocol/placement.py) carry no payload: one HTTP put, no data path.
            for s in range(0, len(items), self.config.max_items):
                records = [spec for spec, _ in items[s : s + self.config.max_items]]
                try:
                    answer = await self.call("/v1/put", {"ns": self.namespace.id, "commit": commit,
                                                         "items": [x.to_wire() for x in records]})
                    out.extend(results_of(answer, len(records)))
                except (StoreError, WireError) as err:
                    self._failures.record("put", err)
                    out.extend(ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE) for _ in records)
            return out
        for s, e in item_chunks([spec for spec, _ in items], self.config.max_items):
            chunk = items[s:e]
            views = [as_view(buf) for _, buf in chunk]
            specs = await with_payloads([spec for spec, _ in chunk], views)
            out.extend(await self.data.write(specs, views, commit))
        return out

    async def prepare(self) -> bool:
        """The data path set up ahead of the first transfer (PrefixClient.prepare): whether payloads
        will take NIXL."""
        return await self.data.prepare()

    async def save(self, prompt: Prompt, kv_upto: int, kv_payload: Callable[[int, int], Buffer],
                   snapshots: Mapping[int, Buffer] | None = None, start: int = 0,
                   origins: Mapping[int, int] | None = None) -> SaveResult:
        """Offer KV [start, kv_upto) and snapshots, then put what the store wants.

        ``kv_payload(a, b)`` returns the store-layout payload of tokens [a, b)
        (layer-major, see KVLayout). It is called for every item of a batch sent
        without an offer (below), else only for the items the offer wanted; never twice for one item.
        ``snapshots`` maps boundaries t <= kv_upto to state payloads; ``origins`` maps a
        boundary to why the engine took it (protocol.keys.Origin, offered with the item: the
        store's adaptive admission and eviction judge prompt ends, generation ends, junctions
        and periodic states apart). A boundary it does not name is offered as unknown (0).

        Items go batch by batch (``max_items``): offer batch k, put what it
        wants, then offer batch k+1. Offering everything first fails past one
        batch: the store rejects a block whose parent was offered but not yet
        stored ("parent not stored"), and every block after it chains off it.
        Once a batch is dropped because the store is unavailable, the rest are
        dropped without asking (their parents are missing anyway).

        With ``small_save_bytes`` above 0 (the vLLM connector's setting; the client's default is
        0) a batch is not offered where the store can decide it from the put itself
        (DataPath.write_unoffered): one of at most that many payload bytes goes as one HTTP put, a
        larger one over NIXL is decided by its reserve before any byte moves. Either way a round
        trip is saved. A put refused whole over the tenant's quota is offered after all, so what
        fits is stored (the store keeps the admission decisions it made, so each item is still
        judged once).
        """
        items = save_items(prompt, kv_upto, kv_payload, snapshots, start, origins)
        final: list[ItemResult] = []  # per item: its put result where it was put, else its offer decision
        put: list[tuple[Kind, ItemResult]] = []
        gone = False
        for s in range(0, len(items), self.config.max_items):
            chunk = items[s : s + self.config.max_items]
            if gone:
                final.extend(ItemResult(ItemStatus.DROPPED, Reason.UNAVAILABLE) for _ in chunk)
                continue
            payloads = Payloads(chunk)
            direct = await self._put_unoffered(chunk, payloads)
            if direct is not None:
                outcome, sent = direct
                put.extend((chunk[n].spec.kind, outcome[n]) for n in sent)
            else:
                decisions = await self.offer([it.spec for it in chunk])
                wanted = [n for n, d in enumerate(decisions) if d.status is ItemStatus.WANT]
                results = await self.put([(chunk[n].spec, payloads[n]) for n in wanted]) if wanted else []
                outcome = list(decisions)
                for n, r in zip(wanted, results):
                    outcome[n] = r
                put.extend((chunk[n].spec.kind, r) for n, r in zip(wanted, results))
            final.extend(outcome)
            gone = any(lost(r) for r in outcome)
        return tally(final, put, [it.spec.size for it in items])

    async def _put_unoffered(self, chunk: Sequence[SaveItem], payloads: Payloads
                             ) -> tuple[list[ItemResult], list[int]] | None:
        """One batch of a save with no offer before it (:meth:`save`), or None where it must be offered."""
        small = self.config.small_save_bytes
        if small == 0 or (sum(it.spec.size for it in chunk) > small and await self.data.ready() is None):
            return None  # offered: payloads are made only for what the offer wants
        views = [as_view(payloads[n]) for n in range(len(chunk))]
        specs = await with_payloads([it.spec for it in chunk], views)
        return await self.data.write_unoffered(specs, views)


class Payloads:
    """A save batch's payloads, each made at most once: a batch refused whole over quota after its
    payloads were made for an unoffered put is offered, and the put of what the offer wants reuses
    them (an engine's payload is a copy out of its KV blocks)."""

    def __init__(self, chunk: Sequence[SaveItem]) -> None:
        self._chunk = chunk
        self._made: dict[int, Buffer] = {}

    def __getitem__(self, n: int) -> Buffer:
        made = self._made.get(n)
        if made is None:
            made = self._made[n] = self._chunk[n].payload()
        return made


def item_chunks(specs: Sequence[ItemSpec], max_items: int) -> Iterator[tuple[int, int]]:
    """The calls ``specs`` go in: [s, e) ranges of at most ``max_items`` items, in order. A range
    never ends between an item and the snapshots right after it: a store decides a snapshot against
    its container in the same offer (or already stored), and answers ``container_missing`` where the
    container came in the call before, not stored yet (a cluster save offers its whole chain before
    putting any of it, in level order: client/saves.py). A block with ``max_items`` snapshots or more
    cannot share a call with them all; the ones past it are refused, as they were before."""
    s, n = 0, len(specs)
    while s < n:
        e = min(s + max_items, n)
        cut = e
        while s < cut < n and specs[cut].kind is Kind.STATE:
            cut -= 1  # back to the item the snapshots follow: it opens the next call with them
        if cut > s:
            e = cut
        yield s, e
        s = e


def check_device_outs(items: Sequence[GetItem], outs: Sequence[object], config: ClientConfig) -> None:
    """read_device's preconditions (a programming error raises; the store never does)."""
    if len(items) != len(outs):
        raise ValueError("read_device: one output buffer per item")
    if not all(isinstance(o, DeviceBuffer) for o in outs):
        raise TypeError("read_device: outputs must be DeviceBuffer (DeviceBuffer.of(tensor))")
    if config.verify_checksums:
        raise ValueError("read_device: the client cannot check GPU memory against xxh3 (DESIGN: every "
                         "crossing verified); set verify_checksums=False to trust leases instead")


__all__ = ["NodeClient", "Observer", "check_device_outs", "item_chunks"]
