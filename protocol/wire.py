"""Wire format: a versioned frame of one msgpack header plus raw payloads.

::

    0      3   4            8              8+H
    | "PSF" | v | header_len | header (msgpack map) | payload 0 | payload 1 | ...
              u8  u32 LE                             sizes are listed in the header

Headers are msgpack maps with string keys; hashes and token ids travel as
``bin`` (16-byte hashes concatenated; tokens as little-endian uint32), which
msgpack copies without per-element work. Payloads follow the header raw, in
the order the header lists them, so neither side copies them to parse. Never
pickle. Every ``from_header`` validates types and bounds and raises
:class:`WireError` naming the field, which the server answers with a 4xx.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

import msgpack

from .errors import ItemStatus, Problem, Reason
from .match import Levels
from .fields import (  # re-exported (__all__): the readers and WireError have always been importable from here
    KIND_BYTES,
    WireError,
    is_entry_key,
    opt_bin,
    req_bin,
    req_bool,
    req_entry_keys,
    req_int,
    req_kind,
    req_list,
    req_map,
    split_hashes,
)
from .hashing import HASH_BYTES, TOKEN_BYTES, BlockHash
from .nixl_wire import NixlPlacements
from .keys import ENTRY_KEY_BYTES, Kind, Origin
from .namespace import NAMESPACE_ID_BYTES

MAGIC: Final = b"PSF"
WIRE_VERSION: Final = 1
PREFIX = struct.Struct("<3sBI")
PREFIX_BYTES: Final = PREFIX.size
CONTENT_TYPE: Final = "application/x-prefixstore-frame"


# ---------------------------------------------------------------- framing


def encode_header(header: dict[str, object]) -> bytes:
    body = msgpack.packb(header, use_bin_type=True)
    return PREFIX.pack(MAGIC, WIRE_VERSION, len(body)) + bytes(body)


#: A header value at least this large (a lookup's hashes and tokens) is sent from its own buffer.
LARGE_BIN_BYTES: Final = 1 << 16
_BIN32 = struct.Struct(">BI")


def encode_header_parts(header: dict[str, object]) -> list[bytes | memoryview]:
    """The prefix and header of a frame as buffers to send in order, the same bytes as
    :func:`encode_header` (msgpack encodes a ``bin`` of 64 KiB or more as bin 32 either way), but
    every such value is one of the parts itself, never copied: a 131,072-token lookup's 655 KB of
    hashes and tokens were copied twice (into msgpack's buffer, then behind the prefix), each copy
    into memory freshly faulted in (docs/benchmarks.md)."""
    if len(header) >= 1 << 16:
        raise ValueError("header: too many fields")
    parts: list[bytes | memoryview] = []
    small = [bytes([0x80 | len(header)]) if len(header) < 16 else struct.pack(">BH", 0xDE, len(header))]
    for key, value in header.items():
        small.append(msgpack.packb(key, use_bin_type=True))
        if isinstance(value, (bytes, memoryview)) and (n := memoryview(value).nbytes) >= LARGE_BIN_BYTES:
            small.append(_BIN32.pack(0xC6, n))
            parts += [b"".join(small), memoryview(value).cast("B")]
            small = []
        else:
            small.append(msgpack.packb(value, use_bin_type=True))
    parts.append(b"".join(small))
    length = sum(memoryview(p).nbytes for p in parts)
    parts[0] = PREFIX.pack(MAGIC, WIRE_VERSION, length) + parts[0]
    return [p for p in parts if memoryview(p).nbytes]


def encode_frame(header: dict[str, object], payloads: Sequence[bytes | memoryview] = (), lead: bytes = b"") -> bytes:
    """Whole frame in one buffer (control messages and tests; bulk paths stream), after ``lead``
    (a control channel's call id and op): one copy of a 131,072-token lookup's hashes, not two."""
    body = msgpack.packb(header, use_bin_type=True)
    return b"".join([lead, PREFIX.pack(MAGIC, WIRE_VERSION, len(body)), body, *payloads])


def parse_prefix(prefix: bytes, max_header_bytes: int) -> int:
    """Validate the 8-byte prefix and return the header length."""
    if len(prefix) < PREFIX_BYTES:
        raise WireError("frame", f"truncated: {len(prefix)} bytes, the prefix alone is {PREFIX_BYTES}")
    magic, version, header_len = PREFIX.unpack_from(prefix)
    if magic != MAGIC:
        raise WireError("frame", f"bad magic {magic!r}: not a prefixstore frame (expected {MAGIC!r})")
    if version != WIRE_VERSION:
        raise WireError("frame.version", f"wire version {version} is not supported (this server speaks {WIRE_VERSION})")
    if header_len > max_header_bytes:
        raise WireError("frame.header_len", f"{header_len} bytes exceeds the limit of {max_header_bytes}", Problem.TOO_LARGE)
    return int(header_len)


def decode_header(raw: bytes | memoryview) -> dict[str, object]:
    try:
        header = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=len(raw), max_str_len=len(raw))
    except Exception as err:  # msgpack raises several unrelated types on garbage
        raise WireError("frame.header", f"not valid msgpack ({type(err).__name__})") from err
    if not isinstance(header, dict):
        raise WireError("frame.header", f"expected a map, got {type(header).__name__}")
    return header


def decode_frame(body: bytes, max_header_bytes: int = 1 << 26) -> tuple[dict[str, object], memoryview]:
    """Split a whole frame into header and the payload bytes that follow it."""
    header_len = parse_prefix(body[:PREFIX_BYTES], max_header_bytes)
    end = PREFIX_BYTES + header_len
    if len(body) < end:
        raise WireError("frame.header_len", f"says {header_len} bytes but only {len(body) - PREFIX_BYTES} follow")
    return decode_header(memoryview(body)[PREFIX_BYTES:end]), memoryview(body)[end:]


# ---------------------------------------------------------------- limits

#: Most bytes of extra keys (LoRA id, multimodal item hashes) one block may carry. They enter its
#: hash, and the store keeps them with the entry (in memory and in LMDB), so they are bounded like
#: everything else a request makes the store hold: 64 hashes of 16 bytes is far more than a block
#: overlaps in practice.
MAX_EXTRA_BYTES: Final = 1024


@dataclass(frozen=True, kw_only=True)
class Limits:
    """Bounds on every request, so a malformed or hostile one costs little."""

    max_header_bytes: int = 8 << 20
    max_items: int = 4096
    max_lookup_blocks: int = 1 << 17
    max_lookup_tokens: int = 1 << 21
    max_body_bytes: int = 1 << 30


# ---------------------------------------------------------------- messages


@dataclass(frozen=True, kw_only=True, slots=True)
class LookupRequest:
    """The full-block hashes of a prompt plus the tokens the match may need (see docs/design.md:
    the store uses tokens only to finish a match inside one block and to count the junction it
    sights; full blocks are matched by hash).

    A **lean** request (``spans`` set) carries the tokens of some levels only, and the prompt's
    length in ``total_tokens``; the store answers ``need_level`` when the match stops at a level
    it did not carry and has children to compare there (protocol/match.py), and the client asks
    again with that level. A request without ``spans`` (every client before it) carries the whole
    prompt and is answered as ever: both forms stay served."""

    namespace_id: bytes
    hashes: bytes  # n x 16 bytes, h_1 .. h_n
    tokens: bytes  # packed uint32: the whole prompt, or with spans the levels they name, concatenated
    lease: bool = True
    locations: bool = False
    extras: tuple[tuple[int, bytes], ...] = ()  # (0-based block index, extra keys) where non-empty
    nixl: bool = False  # also answer where the matched payloads lie in the store's registered memory
    spans: tuple[tuple[int, int], ...] | None = None  # (first level, levels) whose tokens are carried
    total_tokens: int = -1  # the prompt's length; required with spans

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) // HASH_BYTES

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES if self.spans is None else self.total_tokens

    def levels(self, block_tokens: int, root: bytes) -> Levels:
        """The prompt's levels from 0 (the namespace's ``root``), as the matcher reads them."""
        return Levels(0, root, self.hashes, self.tokens, block_tokens, dict(self.extras), self.spans,
                      self.num_tokens)

    def to_header(self) -> dict[str, object]:
        return self.lean_header(self.tokens, self.spans, self.total_tokens)

    def lean_header(self, tokens: bytes, spans: tuple[tuple[int, int], ...] | None,
                    total_tokens: int) -> dict[str, object]:
        """The header of this request carrying ``tokens`` of ``spans`` (None: every token) instead:
        a lean ask (client/node.py ``ask_lean``) without making another request first."""
        d: dict[str, object] = {"ns": self.namespace_id, "hashes": self.hashes, "tokens": tokens,
                                "lease": self.lease, "locations": self.locations}
        if self.nixl:
            d["nixl"] = True
        if self.extras:
            d["extras"] = [[i, x] for i, x in self.extras]
        if spans is not None:
            d["spans"] = [[first, count] for first, count in spans]
            d["total_tokens"] = total_tokens
        return d

    @classmethod
    def from_header(cls, h: dict[str, object], limits: Limits, block_tokens_of: Callable[[bytes], int]) -> LookupRequest:
        ns = req_bin(h, "ns", size=NAMESPACE_ID_BYTES)
        hashes = req_bin(h, "hashes", multiple=HASH_BYTES)
        tokens = req_bin(h, "tokens", multiple=TOKEN_BYTES)
        num_blocks, num_tokens = len(hashes) // HASH_BYTES, len(tokens) // TOKEN_BYTES
        lean = h.get("spans") is not None
        if lean:
            num_tokens = req_int(h, "total_tokens")
        if num_blocks > limits.max_lookup_blocks:
            raise WireError("hashes", f"{num_blocks} blocks exceeds the limit of {limits.max_lookup_blocks}", Problem.TOO_LARGE)
        if num_tokens > limits.max_lookup_tokens:
            raise WireError("total_tokens" if lean else "tokens",
                            f"{num_tokens} tokens exceeds the limit of {limits.max_lookup_tokens}", Problem.TOO_LARGE)
        B = block_tokens_of(ns)
        if num_blocks != num_tokens // B:
            raise WireError("hashes", f"{num_blocks} hashes for {num_tokens} tokens; expected {num_tokens // B} at block size {B}")
        spans = read_spans(h, num_tokens, B, len(tokens) // TOKEN_BYTES) if lean else None
        extras: list[tuple[int, bytes]] = []
        if h.get("extras") is not None:
            raw = req_list(h, "extras", "", limits.max_lookup_blocks)
            limit = -(-num_tokens // B)
            for i, pair in enumerate(raw):
                if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], int)
                        or isinstance(pair[0], bool) or not 0 <= pair[0] < limit or not isinstance(pair[1], bytes)):
                    raise WireError(f"extras[{i}]", f"expected [block index in [0, {limit}), binary extra keys]")
                if len(pair[1]) > MAX_EXTRA_BYTES:
                    raise WireError(f"extras[{i}]", f"{len(pair[1])} bytes of extra keys, at most {MAX_EXTRA_BYTES}",
                                    Problem.TOO_LARGE)
                extras.append((pair[0], pair[1]))
        return cls(namespace_id=ns, hashes=hashes, tokens=tokens, extras=tuple(extras),
                   lease=req_bool(h, "lease", default=True), locations=req_bool(h, "locations", default=False),
                   nixl=req_bool(h, "nixl", default=False), spans=spans, total_tokens=num_tokens if lean else -1)


def read_spans(h: dict[str, object], num_tokens: int, block_tokens: int,
               carried: int) -> tuple[tuple[int, int], ...]:
    """A lean lookup's ``spans``: ascending, disjoint [first level, levels] pairs inside the prompt's
    levels, whose tokens add up to exactly the ``carried`` tokens."""
    B = block_tokens
    levels = -(-num_tokens // B)
    raw = req_list(h, "spans", "", levels)
    out: list[tuple[int, int]] = []
    expect, after = 0, 0
    for i, pair in enumerate(raw):
        if (not isinstance(pair, list) or len(pair) != 2 or not all(isinstance(x, int) and not isinstance(x, bool)
                                                                      for x in pair)):
            raise WireError(f"spans[{i}]", "expected [first level, number of levels]")
        first, count = pair
        if first < after or count < 1 or first + count > levels:
            raise WireError(f"spans[{i}]", f"[{first}, {count}]: spans must be ascending, disjoint and inside "
                            f"the prompt's {levels} levels")
        out.append((first, count))
        after = first + count
        expect += min(after * B, num_tokens) - first * B
    if expect != carried:
        raise WireError("tokens", f"{carried} tokens carried; the spans name {expect}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class EntryRef:
    """Where one payload of a lookup answer lives."""

    key: bytes  # 17-byte entry key
    num_tokens: int  # tokens the entry covers (0 for a snapshot)
    usable_tokens: int  # tokens of it that agree with the prompt (KV), or the boundary (state)
    size: int
    tier: str

    def to_wire(self) -> list[object]:
        return [self.key, self.num_tokens, self.usable_tokens, self.size, self.tier]

    @classmethod
    def from_wire(cls, raw: object, ctx: str = "entry") -> EntryRef:
        if not isinstance(raw, list) or len(raw) != 5:
            raise WireError(ctx, "expected [key, num_tokens, usable_tokens, size, tier]")
        h = dict(zip(("key", "num_tokens", "usable_tokens", "size", "tier"), raw))
        key = req_bin(h, "key", f"{ctx}.", size=ENTRY_KEY_BYTES)
        tier = h["tier"]
        if not isinstance(tier, str):
            raise WireError(f"{ctx}.tier", f"expected a string, got {type(tier).__name__}")
        return cls(key=key, num_tokens=req_int(h, "num_tokens", f"{ctx}."),
                   usable_tokens=req_int(h, "usable_tokens", f"{ctx}."), size=req_int(h, "size", f"{ctx}."), tier=tier)


@dataclass(frozen=True, kw_only=True, slots=True)
class LookupAnswer:
    """The store's answer: the longest token-exact match and where its bytes are.

    ``matched_blocks`` full blocks of the prompt (h_1..h_m) are stored; ``child``
    is the stored block or tail under h_m that extends the match furthest
    (``usable_tokens`` of it agree with the prompt); ``snapshot`` is the state
    at ``state_tokens``. ``checkpoint_hint`` is the junction the engine should
    snapshot (0 when none).
    """

    num_tokens: int
    matched_blocks: int
    kv_tokens: int
    state_tokens: int
    checkpoint_hint: int
    block_bytes: int
    child: EntryRef | None = None
    snapshot: EntryRef | None = None
    lease_id: bytes | None = None
    lease_ttl_s: float = 0.0
    block_tiers: bytes | None = None  # one byte per matched block: 0 ram, 1 disk
    nixl: NixlPlacements | None = None
    """Asked with ``nixl``, from a store serving NIXL: where the matched payloads lie in its
    registered memory, pinned by the lease (store/nixl_lookup.py says what; client/nixl_path.py
    ``LookupRuns`` reads it)."""
    need_level: int | None = None
    """A lean request's match stopped at this level, whose tokens it did not carry: no answer yet
    (nothing leased, nothing learned); ask again carrying them (LookupRequest)."""

    def to_header(self) -> dict[str, object]:
        if self.need_level is not None:
            return {"num_tokens": self.num_tokens, "need_level": self.need_level}
        return {
            "nixl": self.nixl.to_wire() if self.nixl is not None else None,
            "num_tokens": self.num_tokens, "matched_blocks": self.matched_blocks,
            "kv_tokens": self.kv_tokens, "state_tokens": self.state_tokens,
            "checkpoint_hint": self.checkpoint_hint, "block_bytes": self.block_bytes,
            "child": self.child.to_wire() if self.child else None,
            "snapshot": self.snapshot.to_wire() if self.snapshot else None,
            "lease": self.lease_id, "lease_ttl_s": self.lease_ttl_s, "block_tiers": self.block_tiers,
        }

    @classmethod
    def from_header(cls, h: dict[str, object]) -> LookupAnswer:
        if h.get("need_level") is not None:
            return cls(num_tokens=req_int(h, "num_tokens"), matched_blocks=0, kv_tokens=0, state_tokens=0,
                       checkpoint_hint=0, block_bytes=0, need_level=req_int(h, "need_level"))
        child, snap = h.get("child"), h.get("snapshot")
        ttl = h.get("lease_ttl_s", 0.0)
        return cls(
            num_tokens=req_int(h, "num_tokens"), matched_blocks=req_int(h, "matched_blocks"),
            kv_tokens=req_int(h, "kv_tokens"), state_tokens=req_int(h, "state_tokens"),
            checkpoint_hint=req_int(h, "checkpoint_hint"), block_bytes=req_int(h, "block_bytes"),
            child=EntryRef.from_wire(child, "child") if child is not None else None,
            snapshot=EntryRef.from_wire(snap, "snapshot") if snap is not None else None,
            lease_id=opt_bin(h, "lease"), lease_ttl_s=float(ttl) if isinstance(ttl, (int, float)) else 0.0,
            block_tiers=opt_bin(h, "block_tiers"),
            nixl=NixlPlacements.from_wire(h["nixl"]) if h.get("nixl") is not None else None,
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class ItemSpec:
    """One entry offered or put.

    BLOCK / TAIL: ``parent`` is h_{j} of the block before it (or h_0, the
    root), ``tokens`` its token ids, ``extra`` its extra keys; the store
    recomputes ``hash`` from them and rejects a mismatch.
    STATE: ``container`` is the entry key of the block or tail whose token
    range (start, end] holds ``boundary``; the store recomputes p(boundary).
    """

    kind: Kind
    hash: BlockHash
    size: int
    parent: BlockHash | None = None
    tokens: bytes = b""
    extra: bytes = b""
    container: bytes | None = None
    boundary: int = 0
    checksum: int | None = None  # xxh3-64 of the payload; required in a put
    origin: int = 0  # snapshots: why the engine took it (protocol.keys.Origin); a hint for eviction
    # Blocks and tails: first token position. Needed only in a cluster, where the
    # parent may live on another node (protocol/placement.py); else derived.
    start: int | None = None
    # Cluster only (protocol/placement.py). ``branch``: the branch key this item is placed by (a
    # cluster client names it on every item; a node of a larger cluster refuses items without it,
    # which is how a single-node client pointed at one is told). ``record``: a block's fork record
    # (tokens and extra keys, no payload: size 0), kept at its level's home while the block itself
    # lives with its branch.
    branch: bytes | None = None
    record: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // TOKEN_BYTES

    def to_wire(self) -> dict[str, object]:
        d: dict[str, object] = {"kind": int(self.kind), "hash": self.hash, "size": self.size}
        if self.kind is Kind.STATE:
            d["container"] = self.container
            d["boundary"] = self.boundary
        else:
            d["parent"] = self.parent
            d["tokens"] = self.tokens
            if self.extra:
                d["extra"] = self.extra
        if self.checksum is not None:
            d["checksum"] = self.checksum
        if self.origin:
            d["origin"] = self.origin
        if self.start is not None and self.kind is not Kind.STATE:
            d["start"] = self.start
        if self.branch is not None:
            d["branch"] = self.branch
        if self.record:
            d["record"] = True
        return d

    @classmethod
    def from_wire(cls, raw: object, ctx: str, max_size: int) -> ItemSpec:
        h = req_map(raw, ctx.rstrip("."))
        kind = req_kind(h, "kind", ctx)
        digest = BlockHash(req_bin(h, "hash", ctx, size=HASH_BYTES))
        record = req_bool(h, "record", ctx, default=False)
        if record and kind is not Kind.BLOCK:
            raise WireError(f"{ctx}record", "only a block has a fork record")
        size = req_int(h, "size", ctx, 0, 0) if record else req_int(h, "size", ctx, 1, max_size)
        checksum = req_int(h, "checksum", ctx, 0, (1 << 64) - 1) if "checksum" in h else None
        branch = req_bin(h, "branch", ctx) if "branch" in h else None
        if branch is not None and len(branch) not in (HASH_BYTES, HASH_BYTES + TOKEN_BYTES):
            raise WireError(f"{ctx}branch", f"expected {HASH_BYTES} or {HASH_BYTES + TOKEN_BYTES} bytes")
        if kind is Kind.STATE:
            container = req_bin(h, "container", ctx, size=ENTRY_KEY_BYTES)
            if container[0] not in (Kind.BLOCK, Kind.TAIL):
                raise WireError(f"{ctx}container", "must name a block or a tail")
            origin = req_int(h, "origin", ctx, 0, max(Origin)) if "origin" in h else 0
            return cls(kind=kind, hash=digest, size=size, container=container,
                       boundary=req_int(h, "boundary", ctx, 1), checksum=checksum, origin=origin, branch=branch)
        parent = BlockHash(req_bin(h, "parent", ctx, size=HASH_BYTES))
        tokens = req_bin(h, "tokens", ctx, multiple=TOKEN_BYTES)
        if not tokens:
            raise WireError(f"{ctx}tokens", "a block or tail holds at least one token")
        extra = req_bin(h, "extra", ctx) if "extra" in h else b""
        if len(extra) > MAX_EXTRA_BYTES:
            raise WireError(f"{ctx}extra", f"{len(extra)} bytes, at most {MAX_EXTRA_BYTES}", Problem.TOO_LARGE)
        start = req_int(h, "start", ctx, 0) if "start" in h else None
        return cls(kind=kind, hash=digest, size=size, parent=parent, tokens=tokens, extra=extra, checksum=checksum,
                   start=start, branch=branch, record=record)


def parse_items(h: dict[str, object], limits: Limits, name: str = "items") -> list[ItemSpec]:
    raw = req_list(h, name, "", limits.max_items)
    return [ItemSpec.from_wire(item, f"{name}[{i}].", limits.max_body_bytes) for i, item in enumerate(raw)]


@dataclass(kw_only=True, slots=True, unsafe_hash=True)
class GetItem:
    """One payload to read: an entry, optionally only layers [layer_start, layer_end) and heads
    [head_start, head_end) of it (None: through the last; protocol/namespace.py
    ``Namespace.payload_runs`` says which bytes that is).

    A hot-path record, not frozen: a get of 64 KiB blocks makes 1,024 of them on the store before
    its first payload byte leaves, and a frozen dataclass's ``__init__`` (one
    ``object.__setattr__`` per field) took 0.60 ms for them against 0.19 ms (measured with
    timeit). Treat it as a value all the same: nothing mutates one after it is made (it hashes by
    its fields, as the frozen one did)."""

    key: bytes
    layer_start: int = 0
    layer_end: int | None = None
    head_start: int = 0
    head_end: int | None = None

    @property
    def whole(self) -> bool:
        """Every layer and every head: the entry's whole payload."""
        return self.layer_start == 0 and self.layer_end is None and self.head_start == 0 and self.head_end is None

    @property
    def all_heads(self) -> bool:
        return self.head_start == 0 and self.head_end is None

    def to_wire(self) -> list[object]:
        if self.all_heads:
            return [self.key, self.layer_start, self.layer_end]
        return [self.key, self.layer_start, self.layer_end, self.head_start, self.head_end]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> GetItem:
        if not isinstance(raw, list) or len(raw) not in (3, 5):
            raise WireError(ctx, "expected [key, layer_start, layer_end] or [key, layer_start, layer_end, "
                                 "head_start, head_end]")
        key, lo, hi = raw[:3]
        if not is_entry_key(key):
            raise WireError(f"{ctx}.key", f"expected a {ENTRY_KEY_BYTES}-byte entry key")
        if not isinstance(lo, int) or isinstance(lo, bool) or lo < 0:
            raise WireError(f"{ctx}.layer_start", "expected a non-negative integer")
        if hi is not None and (not isinstance(hi, int) or isinstance(hi, bool) or hi <= lo):
            raise WireError(f"{ctx}.layer_end", "expected null or an integer above layer_start")
        hs, he = raw[3:] if len(raw) == 5 else (0, None)
        if not isinstance(hs, int) or isinstance(hs, bool) or hs < 0:
            raise WireError(f"{ctx}.head_start", "expected a non-negative integer")
        if he is not None and (not isinstance(he, int) or isinstance(he, bool) or he <= hs):
            raise WireError(f"{ctx}.head_end", "expected null or an integer above head_start")
        return cls(key=key, layer_start=lo, layer_end=hi, head_start=hs, head_end=he)


# A get names its items packed (``encode_get_items``): a 1,024-item get of 64 KiB blocks spent
# more of the store's time building and checking per-item msgpack lists (and answering in them)
# than sending the payloads' bytes (docs/benchmarks.md, "GET at the raw socket's speed"). Packed:
#
#   keys    bin   entry key 0 | entry key 1 | ...            17 bytes each (kind || hash)
#   layers  bin   optional: start 0 | end 0 | start 1 | ...  u32 LE each; end 0 = to the last layer
#   heads   bin   optional, the same for heads: KV heads of a block or tail, state heads of a
#                 snapshot (an engine at tensor-parallel size t reads its own heads)
#
# The older form, ``items: [[key, layer_start, layer_end], ...]``, is still read (a client of an
# earlier release), and answered in its own form (``GetAnswer``).
LAYER_RANGE: Final = struct.Struct("<II")


def _ranges(items: Sequence[GetItem], field: str) -> bytes | None:
    """The packed ``layers`` or ``heads`` of a get (None: no item asks for a range of them)."""
    lo_of, hi_of = (("layer_start", "layer_end") if field == "layers" else ("head_start", "head_end"))
    pairs = [(getattr(it, lo_of), getattr(it, hi_of)) for it in items]
    if not any(lo or hi is not None for lo, hi in pairs):
        return None
    for i, (lo, hi) in enumerate(pairs):
        if not 0 <= lo < 1 << 32 or not (hi is None or lo < hi < 1 << 32):
            raise ValueError(f"items[{i}]: {field} [{lo}, {hi}) is not a range of u32 {field}")
    return b"".join([LAYER_RANGE.pack(lo, hi or 0) for lo, hi in pairs])


def encode_get_items(items: Sequence[GetItem]) -> dict[str, object]:
    """The items part of a get request (HTTP or NIXL), packed; merge it into the header.

    Raises ValueError for an item no store would take (a malformed key, a layer or head range
    that is empty, reversed or beyond u32): a caller's mistake, named here rather than sent."""
    out: dict[str, object] = {"keys": b"".join([it.key for it in items])}
    if len(out["keys"]) != ENTRY_KEY_BYTES * len(items):  # type: ignore[arg-type]
        bad = next(i for i, it in enumerate(items) if len(it.key) != ENTRY_KEY_BYTES)
        raise ValueError(f"items[{bad}].key: expected a {ENTRY_KEY_BYTES}-byte entry key")
    for field in ("layers", "heads"):
        packed = _ranges(items, field)
        if packed is not None:
            out[field] = packed
    return out


def _unpack_ranges(h: dict[str, object], field: str, n: int) -> list[tuple[int, int | None]] | None:
    if field not in h:
        return None
    raw = req_bin(h, field, size=n * LAYER_RANGE.size)
    out: list[tuple[int, int | None]] = []
    for i, (lo, hi) in enumerate(LAYER_RANGE.iter_unpack(raw)):
        if hi and hi <= lo:
            what = "layer" if field == "layers" else "head"
            raise WireError(f"{field}[{i}]", f"{what}_end {hi} is not above {what}_start {lo}")
        out.append((lo, hi or None))
    return out


def parse_get_items(h: dict[str, object], limits: Limits) -> list[GetItem]:
    """The items of a get (HTTP or NIXL): entry keys with optional layer and head ranges, packed
    (``keys``/``layers``/``heads``) or as the older ``items`` list."""
    if "keys" not in h:
        raw = req_list(h, "items", "", limits.max_items)
        return [GetItem.from_wire(x, f"items[{i}]") for i, x in enumerate(raw)]
    keys = req_bin(h, "keys", multiple=ENTRY_KEY_BYTES)
    n = len(keys) // ENTRY_KEY_BYTES
    if n > limits.max_items:
        raise WireError("keys", f"{n} items exceeds the limit of {limits.max_items}", Problem.TOO_LARGE)
    split = [keys[i : i + ENTRY_KEY_BYTES] for i in range(0, len(keys), ENTRY_KEY_BYTES)]
    bad = next((i for i, k in enumerate(split) if k[0] not in KIND_BYTES), None)
    if bad is not None:
        raise WireError(f"keys[{bad}]", f"byte {split[bad][0]} is not an entry kind")
    layers = _unpack_ranges(h, "layers", n)
    heads = _unpack_ranges(h, "heads", n)
    if layers is None and heads is None:
        return [GetItem(key=k) for k in split]
    items: list[GetItem] = []
    for i, k in enumerate(split):
        lo, hi = layers[i] if layers is not None else (0, None)
        hs, he = heads[i] if heads is not None else (0, None)
        items.append(GetItem(key=k, layer_start=lo, layer_end=hi, head_start=hs, head_end=he))
    return items


#: Per-item status in put, commit and get answers (protocol/errors.py ItemStatus; these names stay).
STATUS_OK: Final = ItemStatus.OK
STATUS_HAVE: Final = ItemStatus.HAVE
STATUS_PENDING: Final = ItemStatus.PENDING
STATUS_REJECTED: Final = ItemStatus.REJECTED
STATUS_MISSING: Final = ItemStatus.MISSING
STATUS_CORRUPT: Final = ItemStatus.CORRUPT
STATUS_HTTP: Final = ItemStatus.HTTP
STATUS_DROPPED: Final = ItemStatus.DROPPED

#: Offer decisions.
WANT: Final = ItemStatus.WANT
HAVE: Final = ItemStatus.HAVE
REJECTED: Final = ItemStatus.REJECTED


@dataclass(frozen=True, slots=True)
class ItemResult:
    """One item's answer: its status, why (a :class:`protocol.errors.Reason`, a code on the wire) and,
    where the reason alone does not say it all, ``detail`` in words (what a failed disk write
    raised). Wire form: ``[status, reason]``, or ``[status, reason, {fork, branch, detail}]``."""

    status: ItemStatus
    reason: Reason = Reason.NONE
    # Cluster offers (protocol/placement.py). ``fork``: this block is a fork head at its level's
    # home, which keeps its record (put it with ``record``); the block itself and what hangs from
    # it go to its branch's node. ``branch``: with ELSEWHERE, the branch key whose node takes it.
    fork: bool = False
    branch: bytes | None = None
    detail: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.status, ItemStatus):  # a plain string of a status: typed here, once
            object.__setattr__(self, "status", _status(self.status, "status"))

    @property
    def text(self) -> str:
        """The reason in words, with the detail (for humans: logs, warnings)."""
        words = self.reason.text
        return f"{words}: {self.detail}" if words and self.detail else words or self.detail

    def to_wire(self) -> list[object]:
        if not self.fork and self.branch is None and not self.detail:
            return [self.status.value, self.reason.value]
        placed: dict[str, object] = {"fork": self.fork}
        if self.branch is not None:
            placed["branch"] = self.branch
        if self.detail:
            placed["detail"] = self.detail
        return [self.status.value, self.reason.value, placed]

    @classmethod
    def from_wire(cls, raw: object) -> ItemResult:
        if not isinstance(raw, list) or len(raw) not in (2, 3) or not all(isinstance(x, str) for x in raw[:2]) \
                or (len(raw) == 3 and not isinstance(raw[2], dict)):
            raise WireError("results", "expected [status, reason] strings, and the placement")
        reason, detail = Reason.of_wire(raw[1])
        if len(raw) == 2:
            return cls(_status(raw[0], "results"), reason, detail=detail)
        placed = raw[2]
        branch = placed.get("branch")
        more = placed.get("detail", "")
        if not isinstance(placed.get("fork", False), bool) or not (branch is None or isinstance(branch, bytes)) \
                or not isinstance(more, str):
            raise WireError("results", "placement: expected {fork: bool, branch: bytes, detail: str}")
        return cls(_status(raw[0], "results"), reason, bool(placed.get("fork", False)), branch,
                   "; ".join(d for d in (detail, more) if d))


def _status(raw: object, ctx: str) -> ItemStatus:
    if not isinstance(raw, str):
        raise WireError(ctx, f"expected a status string, got {type(raw).__name__}")
    try:
        return ItemStatus(raw)
    except ValueError:
        raise WireError(ctx, f"unknown item status {raw!r}") from None


#: The one-byte codes of a packed get answer's statuses (``GetAnswer``): a status's code is its
#: place here, so new statuses go at the end.
GET_STATUSES: Final = (ItemStatus.OK, ItemStatus.MISSING, ItemStatus.CORRUPT, ItemStatus.HTTP)
_GET_CODES: Final = {s: i for i, s in enumerate(GET_STATUSES)}


@dataclass(slots=True)
class GetAnswer:
    """A get answer's header: per item a status, and the size and xxh3-64 checksum of each
    payload that follows (0 where none does), in item order.

    Packed (the answer to a packed request)::

        status     bin   one byte per item: its place in GET_STATUSES
        sizes      bin   u64 LE per item
        checksums  bin   u64 LE per item

    or, to a request in the older form, ``items: [[status, size, checksum], ...]``."""

    statuses: list[ItemStatus]
    sizes: list[int]
    checksums: list[int]

    def to_header(self, packed: bool = True) -> dict[str, object]:
        if not packed:
            return {"items": [[st.value, n, c] for st, n, c in zip(self.statuses, self.sizes, self.checksums)]}
        return {"status": bytes([_GET_CODES[st] for st in self.statuses]),
                "sizes": _u64_bytes(self.sizes), "checksums": _u64_bytes(self.checksums)}

    @classmethod
    def from_header(cls, h: dict[str, object], num_items: int) -> GetAnswer:
        """Either form; an answer that lists another number of items than ``num_items`` is refused."""
        if "status" not in h:
            raw = h.get("items")
            if not isinstance(raw, list) or len(raw) != num_items:
                raise WireError("items", "it lists a different number of items than asked for")
            results = [GetResult.from_wire(x) for x in raw]
            return cls([r.status for r in results], [r.size for r in results], [r.checksum for r in results])
        codes = req_bin(h, "status", size=num_items)
        if max(codes, default=0) >= len(GET_STATUSES):
            raise WireError("status", f"unknown item status code {max(codes)}")
        return cls([GET_STATUSES[c] for c in codes], _u64_list(req_bin(h, "sizes", size=8 * num_items)),
                   _u64_list(req_bin(h, "checksums", size=8 * num_items)))


def _u64_bytes(values: list[int]) -> bytes:
    packed = array("Q", values)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def _u64_list(raw: bytes) -> list[int]:
    packed = array("Q", raw)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tolist()


@dataclass(frozen=True, slots=True)
class GetResult:
    status: ItemStatus
    size: int = 0
    checksum: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.status, ItemStatus):
            object.__setattr__(self, "status", _status(self.status, "status"))

    def to_wire(self) -> list[object]:
        return [self.status.value, self.size, self.checksum]

    @classmethod
    def from_wire(cls, raw: object) -> GetResult:
        if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[0], str):
            raise WireError("items", "expected [status, size, checksum]")
        h = {"size": raw[1], "checksum": raw[2]}
        return cls(_status(raw[0], "items"), req_int(h, "size", "items."),
                   req_int(h, "checksum", "items.", 0, (1 << 64) - 1))


__all__ = [
    "CONTENT_TYPE",
    "EntryRef",
    "GET_STATUSES",
    "GetAnswer",
    "GetItem",
    "GetResult",
    "HAVE",
    "ItemResult",
    "ItemSpec",
    "Limits",
    "LookupAnswer",
    "LookupRequest",
    "MAGIC",
    "PREFIX",
    "PREFIX_BYTES",
    "REJECTED",
    "STATUS_CORRUPT",
    "STATUS_DROPPED",
    "STATUS_HAVE",
    "STATUS_HTTP",
    "STATUS_MISSING",
    "STATUS_OK",
    "STATUS_PENDING",
    "STATUS_REJECTED",
    "WANT",
    "WIRE_VERSION",
    "WireError",
    "decode_frame",
    "decode_header",
    "encode_frame",
    "encode_header",
    "encode_header_parts",
    "is_entry_key",
    "opt_bin",
    "encode_get_items",
    "parse_get_items",
    "parse_items",
    "parse_prefix",
    "req_bin",
    "req_bool",
    "req_entry_keys",
    "req_int",
    "req_kind",
    "req_list",
    "req_map",
    "split_hashes",
]
