"""The NIXL data path's messages (docs/nixl.md), typed and validated like every other frame.

Requests reuse the HTTP path's shapes (``{ns, items}`` of GetItems or ItemSpecs; a commit's
``{ns, keys, commit}``); answers are these records. A *runs* value is where a payload lies in
the store's registered memory: (address, length) pairs, uint64 little-endian, concatenated,
covering the payload (or the asked byte range) in order::

    | addr0 u64 | len0 u64 | addr1 u64 | len1 u64 | ...      (len0 + len1 + ... = size)

Every ``from_header`` raises :class:`protocol.fields.WireError` naming the field, so a client
treats a malformed answer as the store failing (a miss), never as bytes to READ.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from .errors import ItemStatus, Reason
from .fields import WireError, opt_bin, req_bin, req_int, req_list
from .keys import ENTRY_KEY_BYTES

RUN = struct.Struct("<2Q")
RUN_BYTES = RUN.size


def _runs(raw: object, ctx: str, required: bool) -> bytes:
    if not isinstance(raw, bytes) or len(raw) % RUN_BYTES or (required and not raw):
        raise WireError(ctx, f"expected (address, length) runs: a non-empty multiple of {RUN_BYTES} bytes"
                        if required else f"expected a multiple of {RUN_BYTES} bytes")
    return raw


def _str(h: dict[str, object], name: str, ctx: str = "") -> str:
    v = h.get(name)
    if not isinstance(v, str):
        raise WireError(f"{ctx}{name}", f"expected a string, got {type(v).__name__}")
    return v


def _seconds(h: dict[str, object], name: str) -> float:
    v = h.get(name, 0.0)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v < 0:
        raise WireError(name, "expected non-negative seconds")
    return float(v)


def _status(raw: object, ctx: str) -> ItemStatus:
    if not isinstance(raw, str):
        raise WireError(ctx, f"expected a status string, got {type(raw).__name__}")
    try:
        return ItemStatus(raw)
    except ValueError:
        raise WireError(ctx, f"unknown item status {raw!r}") from None


@dataclass(frozen=True, kw_only=True, slots=True)
class NixlMetadata:
    """``POST /v1/nixl/metadata``: the store agent's name and metadata (its registered memory).
    ``meta_gen`` changes when the registrations change (LMDB's map moved)."""

    agent: str
    metadata: bytes
    region: tuple[int, int]  # (base address, length) of the arena
    meta_gen: int = 0

    def to_header(self) -> dict[str, object]:
        return {"agent": self.agent, "metadata": self.metadata, "region": list(self.region), "meta_gen": self.meta_gen}

    @classmethod
    def from_header(cls, h: dict[str, object]) -> NixlMetadata:
        region = h.get("region", [0, 0])
        if not isinstance(region, list) or len(region) != 2 or not all(isinstance(x, int) for x in region):
            raise WireError("region", "expected [base, length]")
        return cls(agent=_str(h, "agent"), metadata=req_bin(h, "metadata"), region=(region[0], region[1]),
                   meta_gen=req_int(h, "meta_gen") if "meta_gen" in h else 0)


@dataclass(frozen=True, slots=True)
class NixlItem:
    """One item of a ``/v1/nixl/get`` answer: OK with its runs, HTTP (read it over /v1/get), or a miss."""

    status: ItemStatus
    size: int = 0
    checksum: int = 0
    runs: bytes = b""

    def to_wire(self) -> list[object]:
        return [self.status.value, self.size, self.checksum, self.runs]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> NixlItem:
        if not isinstance(raw, list) or len(raw) != 4:
            raise WireError(ctx, "expected [status, size, checksum, runs]")
        h = {"size": raw[1], "checksum": raw[2]}
        status = _status(raw[0], f"{ctx}.status")
        return cls(status, req_int(h, "size", f"{ctx}."), req_int(h, "checksum", f"{ctx}.", 0, (1 << 64) - 1),
                   _runs(raw[3], f"{ctx}.runs", required=status is ItemStatus.OK))


@dataclass(frozen=True, kw_only=True, slots=True)
class NixlGetAnswer:
    """``POST /v1/nixl/get``: per item where it lies, under one lease (released by /v1/release)."""

    agent: str
    items: tuple[NixlItem, ...]
    lease: bytes | None = None
    lease_ttl_s: float = 0.0
    meta_gen: int = 0

    def to_header(self) -> dict[str, object]:
        return {"agent": self.agent, "items": [i.to_wire() for i in self.items], "lease": self.lease,
                "lease_ttl_s": self.lease_ttl_s, "meta_gen": self.meta_gen}

    @classmethod
    def from_header(cls, h: dict[str, object], num_items: int) -> NixlGetAnswer:
        raw = req_list(h, "items", "", num_items)
        if len(raw) != num_items:
            raise WireError("items", f"expected {num_items} items, got {len(raw)}")
        return cls(agent=_str(h, "agent"), items=tuple(NixlItem.from_wire(x, f"items[{i}]") for i, x in enumerate(raw)),
                   lease=opt_bin(h, "lease", size=16), lease_ttl_s=_seconds(h, "lease_ttl_s"),
                   meta_gen=req_int(h, "meta_gen") if "meta_gen" in h else 0)


@dataclass(frozen=True, slots=True)
class NixlReservation:
    """One item of a ``/v1/nixl/reserve`` answer: PENDING with the runs to WRITE into, or refused."""

    status: ItemStatus
    reason: Reason = Reason.NONE
    runs: bytes = b""

    def to_wire(self) -> list[object]:
        return [self.status.value, self.reason.value, self.runs]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> NixlReservation:
        if not isinstance(raw, list) or len(raw) != 3 or not isinstance(raw[1], str):
            raise WireError(ctx, "expected [status, reason, runs]")
        status = _status(raw[0], f"{ctx}.status")
        reason, _ = Reason.of_wire(raw[1])
        return cls(status, reason, _runs(raw[2], f"{ctx}.runs", required=status is ItemStatus.PENDING))


@dataclass(frozen=True, kw_only=True, slots=True)
class NixlReserveAnswer:
    """``POST /v1/nixl/reserve``: pages reserved per item, for ``ttl_s`` (then reclaimed)."""

    agent: str
    results: tuple[NixlReservation, ...]
    ttl_s: float

    def to_header(self) -> dict[str, object]:
        return {"agent": self.agent, "results": [r.to_wire() for r in self.results], "ttl_s": self.ttl_s}

    @classmethod
    def from_header(cls, h: dict[str, object], num_items: int) -> NixlReserveAnswer:
        raw = req_list(h, "results", "", num_items)
        if len(raw) != num_items:
            raise WireError("results", f"expected {num_items} results, got {len(raw)}")
        return cls(agent=_str(h, "agent"),
                   results=tuple(NixlReservation.from_wire(x, f"results[{i}]") for i, x in enumerate(raw)),
                   ttl_s=_seconds(h, "ttl_s"))


@dataclass(frozen=True, slots=True)
class NixlPlacement:
    """A payload a lookup (or probe) placed for the caller: its wire key, size, xxh3 and runs."""

    key: bytes
    size: int
    checksum: int
    runs: bytes

    def to_wire(self) -> list[object]:
        return [self.key, self.size, self.checksum, self.runs]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> NixlPlacement:
        if not isinstance(raw, list) or len(raw) != 4:
            raise WireError(ctx, "expected [key, size, checksum, runs]")
        h = {"key": raw[0], "size": raw[1], "checksum": raw[2]}
        return cls(req_bin(h, "key", f"{ctx}.", size=ENTRY_KEY_BYTES), req_int(h, "size", f"{ctx}."),
                   req_int(h, "checksum", f"{ctx}.", 0, (1 << 64) - 1), _runs(raw[3], f"{ctx}.runs", required=True))


@dataclass(frozen=True, kw_only=True, slots=True)
class NixlPlacements:
    """The ``nixl`` part of a lookup or probe answer: where the matched payloads lie, pinned by the
    answer's lease (store/nixl_lookup.py; read by client/nixl_path.py ``LookupRuns``)."""

    agent: str
    meta_gen: int
    lease_ttl_s: float
    entries: tuple[NixlPlacement, ...]

    def to_wire(self) -> dict[str, object]:
        return {"agent": self.agent, "meta_gen": self.meta_gen, "lease_ttl_s": self.lease_ttl_s,
                "entries": [e.to_wire() for e in self.entries]}

    @classmethod
    def from_wire(cls, raw: object, max_entries: int = 1 << 20) -> NixlPlacements:
        if not isinstance(raw, dict):
            raise WireError("nixl", "expected a map")
        entries = req_list(raw, "entries", "nixl.", max_entries)
        return cls(agent=_str(raw, "agent", "nixl."), meta_gen=req_int(raw, "meta_gen", "nixl."),
                   lease_ttl_s=_seconds(raw, "lease_ttl_s"),
                   entries=tuple(NixlPlacement.from_wire(x, f"nixl.entries[{i}]") for i, x in enumerate(entries)))


__all__ = ["RUN", "RUN_BYTES", "NixlGetAnswer", "NixlItem", "NixlMetadata", "NixlPlacement", "NixlPlacements",
           "NixlReservation", "NixlReserveAnswer"]
