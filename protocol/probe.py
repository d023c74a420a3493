"""The cluster lookup's per-node question and answer (``POST /v1/probe``): one hop of a walk.

A cluster lookup walks the prompt's branches (protocol/placement.py). Each hop asks one node
about the prompt's **levels** from some level s on: level j is the parent hash h_j (h_0 the
root), the prompt's next block h_{j+1} (absent at a last, partial level), the prompt's tokens of
that block [jB, min((j+1)B, T)) and its extra keys. The request is the prompt itself from level
s on, as a lookup sends it (h_s, the hashes h_{s+1}.., the packed tokens from sB, sparse extra
keys): compact whatever its length, so a 32k-token probe costs what a 32k-token lookup does.
Like a lookup it may be **lean** (``spans``, ``total_tokens``; protocol/match.py): tokens of its
first level (the root level's branch key is read from it) and of some others only; a node whose
run stops at a level the probe did not carry, with something there to compare, answers
``need_level`` and nothing else, and the client asks again carrying it.

The node answers the levels in order, each with exactly what a single node's lookup computes
there, and stops at the first level that ends its part. The answer is run-shaped:

* ``held`` = k: blocks h_{s+1} .. h_{s+k} are stored here in full, each under the one before --
  levels s .. s+k-1 go on;
* ``stop``: level s+k (when the request has it) ends this node's part, either
  ``fork``: what is stored here is h_{s+k+1}'s fork record: the prompt continues on that
  block's branch node, which the client asks next from level s+k (there the block is held); or
  not held: ``child``, the stored child of h_{s+k} (block, tail, or another fork head's record)
  whose tokens agree longest with the segment (``usable_tokens`` of them), ends the match;
* ``snapshots``: per level of the run and the stop level that has one, the largest-boundary
  snapshot registered under h_j whose container agrees with the prompt up to its boundary and
  whose boundary the KV of that level reaches ((j+1)B when h_{j+1} is held, jB + the child's
  usable tokens otherwise);
* ``inexact``: the levels answered here that this node is not the home of (it does not hold all
  of the level, so ``child`` and ``snapshot`` there may not be the single-node answer): the
  branch node confirming its fork head at level s, a node holding hot copies. The client asks the
  home where an exact answer matters (client/walk.py).

A child that is a fork record has tier ``elsewhere`` (its payload is on its branch node, which
the client asks to confirm and lease it). The client takes the first level that is not held as
the end of the matched block run (m), its child as the match's end, and the best snapshot of the
levels 0..m: the single-node answer. ``replicas`` maps entry keys of this answer that have copies
on other nodes to those nodes, so the client can spread its hops and reads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .hashing import HASH_BYTES, TOKEN_BYTES
from .namespace import NAMESPACE_ID_BYTES
from .errors import Problem
from .match import Levels
from .nixl_wire import NixlPlacements
from .wire import MAX_EXTRA_BYTES, EntryRef, Limits, WireError, opt_bin, read_spans, req_bin, req_bool, req_int, req_list


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRequest:
    """Levels ``start`` .. of one prompt: ``parent`` = h_start (the root at level 0), ``hashes`` =
    h_{start+1} .. h_{start+k} concatenated (levels with a next block), ``tokens`` = the prompt's
    tokens from start·B on, packed uint32: exactly k blocks, or k blocks and a partial last level;
    lean (``spans`` set): the tokens of the levels ``spans`` names (relative to ``start``; the first
    always among them), concatenated, and ``total_tokens`` the prompt's tokens from start·B on."""

    namespace_id: bytes
    start: int
    parent: bytes
    hashes: bytes
    tokens: bytes
    extras: tuple[tuple[int, bytes], ...] = ()  # (level j, extra keys of the prompt's block j+1), sparse
    lease: bool = True
    nixl: bool = False  # also answer where the reported payloads lie (as a lookup does; store/nixl_lookup.py)
    spans: tuple[tuple[int, int], ...] | None = None  # (first level from start, levels) whose tokens are carried
    total_tokens: int = -1  # the prompt's tokens from start·B on; required with spans

    @property
    def num_blocks(self) -> int:
        return len(self.hashes) // HASH_BYTES

    @property
    def num_tokens(self) -> int:
        """The prompt's tokens from ``start``·B on, carried or not."""
        return len(self.tokens) // TOKEN_BYTES if self.spans is None else self.total_tokens

    def num_levels(self, block_tokens: int) -> int:
        return self.levels(block_tokens).num_levels

    def levels(self, block_tokens: int) -> Levels:
        """The prompt's levels from ``start`` on, as the matcher reads them."""
        return Levels(self.start, self.parent, self.hashes, self.tokens, block_tokens, dict(self.extras),
                      self.spans, self.num_tokens)

    def to_header(self) -> dict[str, object]:
        return self.lean_header(self.tokens, self.spans, self.total_tokens)

    def lean_header(self, tokens: bytes, spans: tuple[tuple[int, int], ...] | None,
                    total_tokens: int) -> dict[str, object]:
        """The header of this request carrying ``tokens`` of ``spans`` (None: every token) instead:
        a lean ask (client/node.py ``ask_lean``) without making another request first."""
        d: dict[str, object] = {"ns": self.namespace_id, "start": self.start, "parent": self.parent,
                                "hashes": self.hashes, "tokens": tokens, "lease": self.lease}
        if self.extras:
            d["extras"] = [[j, e] for j, e in self.extras]
        if self.nixl:
            d["nixl"] = True
        if spans is not None:
            d["spans"] = [[first, count] for first, count in spans]
            d["total_tokens"] = total_tokens
        return d

    @classmethod
    def from_header(cls, h: dict[str, object], limits: Limits,
                    block_tokens_of: Callable[[bytes], int]) -> ProbeRequest:
        ns = req_bin(h, "ns", size=NAMESPACE_ID_BYTES)
        B = block_tokens_of(ns)
        max_levels = limits.max_lookup_tokens // B + 1  # a prompt's levels: its full blocks and one more
        start = req_int(h, "start", hi=max_levels - 1)
        parent = req_bin(h, "parent", size=HASH_BYTES)
        hashes = req_bin(h, "hashes", multiple=HASH_BYTES)
        tokens = req_bin(h, "tokens", multiple=TOKEN_BYTES)
        lean = h.get("spans") is not None
        length = "total_tokens" if lean else "tokens"
        k, T = len(hashes) // HASH_BYTES, req_int(h, "total_tokens") if lean else len(tokens) // TOKEN_BYTES
        if T > limits.max_lookup_tokens:
            raise WireError(length, f"{T} tokens, at most {limits.max_lookup_tokens} (max_lookup_tokens)",
                            Problem.TOO_LARGE)
        # The prompt from level start on: k full blocks (one per hash), then at most a partial level.
        if not k * B <= T < (k + 1) * B or T == 0:
            raise WireError(length, f"expected {k} blocks of {B} tokens (one per hash) and fewer than {B} "
                            f"more, got {T} tokens")
        levels = k + (1 if T > k * B else 0)
        if start + levels > max_levels:
            raise WireError("start", f"levels up to {start + levels - 1} are past the longest prompt "
                            f"(max_lookup_tokens={limits.max_lookup_tokens})", Problem.TOO_LARGE)
        spans = read_spans(h, T, B, len(tokens) // TOKEN_BYTES) if lean else None
        if spans is not None and (not spans or spans[0][0] != 0):
            # The node reads the root level's branch key, and the first level's children, from it.
            raise WireError("spans", "a lean probe carries its first level's tokens: spans start at level 0")
        extras: list[tuple[int, bytes]] = []
        raw = h.get("extras")
        if raw is not None:
            if not isinstance(raw, list) or len(raw) > levels:
                raise WireError("extras", f"expected a list of at most {levels} [level, extra keys]")
            seen: set[int] = set()
            for i, x in enumerate(raw):
                if not isinstance(x, list) or len(x) != 2 or not isinstance(x[0], int) or isinstance(x[0], bool) \
                        or not isinstance(x[1], bytes):
                    raise WireError(f"extras[{i}]", "expected [level, extra keys]")
                if not start <= x[0] < start + levels or x[0] in seen:
                    raise WireError(f"extras[{i}]", f"level {x[0]} is not one of this probe's, or repeated")
                if len(x[1]) > MAX_EXTRA_BYTES:
                    raise WireError(f"extras[{i}]", f"{len(x[1])} bytes, at most {MAX_EXTRA_BYTES}", Problem.TOO_LARGE)
                seen.add(x[0])
                if x[1]:
                    extras.append((x[0], x[1]))
        return cls(namespace_id=ns, start=start, parent=parent, hashes=hashes, tokens=tokens, extras=tuple(extras),
                   lease=req_bool(h, "lease", default=True), nixl=req_bool(h, "nixl", default=False),
                   spans=spans, total_tokens=T if lean else -1)


TIER_ELSEWHERE = "elsewhere"
"""The tier of a child that is a fork record: its payload is on its branch node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StopLevel:
    """The level that ends a node's part of a probe (module docstring)."""

    fork: bool = False  # the next block is held here as a fork record: continue on its branch node
    child: EntryRef | None = None  # else: the best stored child of the level (the match ends inside it)

    def to_wire(self) -> list[object]:
        return [self.fork, self.child.to_wire() if self.child is not None else None]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> StopLevel:
        if not isinstance(raw, list) or len(raw) != 2 or not isinstance(raw[0], bool):
            raise WireError(ctx, "expected [fork, child]")
        return cls(fork=raw[0], child=EntryRef.from_wire(raw[1], f"{ctx}.child") if raw[1] is not None else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeAnswer:
    start: int
    held: int = 0  # levels start .. start+held-1: their next block is stored here in full
    stop: StopLevel | None = None  # level start+held, when the probe asked it
    inexact: tuple[int, ...] = ()  # levels answered that this node is not the home of
    snapshots: dict[int, EntryRef] = field(default_factory=dict)  # level -> its best snapshot
    lease_id: bytes | None = None
    lease_ttl_s: float = 0.0
    replicas: dict[bytes, tuple[str, ...]] = field(default_factory=dict)
    nixl: NixlPlacements | None = None  # asked with ``nixl``: placements, as in a LookupAnswer
    need_level: int | None = None
    """A lean probe's run stopped at this level (absolute), whose tokens it did not carry, with
    something stored there to compare: no answer yet (nothing leased); ask again carrying them."""

    @property
    def end(self) -> int:
        """The last level answered: the stop level, or the last held one."""
        return self.start + self.held if self.stop is not None else self.start + self.held - 1

    def to_header(self) -> dict[str, object]:
        if self.need_level is not None:
            return {"start": self.start, "need_level": self.need_level}
        return {"start": self.start, "held": self.held, "stop": self.stop.to_wire() if self.stop else None,
                "inexact": list(self.inexact), "snaps": [[j, r.to_wire()] for j, r in self.snapshots.items()],
                "lease": self.lease_id, "lease_ttl_s": self.lease_ttl_s,
                "replicas": {k.hex(): list(v) for k, v in self.replicas.items()},
                "nixl": self.nixl.to_wire() if self.nixl is not None else None}

    @classmethod
    def from_header(cls, h: dict[str, object]) -> ProbeAnswer:
        start = req_int(h, "start")
        if h.get("need_level") is not None:
            return cls(start=start, need_level=req_int(h, "need_level", lo=start))
        held = req_int(h, "held")
        end = start + held
        inexact = req_list(h, "inexact", "", held + 1)
        if not all(isinstance(j, int) and not isinstance(j, bool) and start <= j <= end for j in inexact):
            raise WireError("inexact", f"expected levels in [{start}, {end}]")
        snapshots: dict[int, EntryRef] = {}
        for i, x in enumerate(req_list(h, "snaps", "", held + 1)):
            if not isinstance(x, list) or len(x) != 2 or not isinstance(x[0], int) or not start <= x[0] <= end:
                raise WireError(f"snaps[{i}]", f"expected [level in [{start}, {end}], entry]")
            snapshots[x[0]] = EntryRef.from_wire(x[1], f"snaps[{i}]")
        replicas: dict[bytes, tuple[str, ...]] = {}
        rep = h.get("replicas") or {}
        if not isinstance(rep, dict):
            raise WireError("replicas", "expected a map")
        for k, v in rep.items():
            if not isinstance(k, str) or not isinstance(v, list) or not all(isinstance(u, str) for u in v):
                raise WireError("replicas", "expected {entry key hex: [node url]}")
            try:
                replicas[bytes.fromhex(k)] = tuple(v)
            except ValueError as err:
                raise WireError("replicas", f"key {k!r} is not hex") from err
        ttl = h.get("lease_ttl_s", 0.0)
        return cls(start=start, held=held,
                   stop=StopLevel.from_wire(h["stop"], "stop") if h.get("stop") is not None else None,
                   inexact=tuple(j for j in inexact if isinstance(j, int)), snapshots=snapshots,
                   lease_id=opt_bin(h, "lease"), lease_ttl_s=float(ttl) if isinstance(ttl, (int, float)) else 0.0,
                   replicas=replicas,
                   nixl=NixlPlacements.from_wire(h["nixl"]) if h.get("nixl") is not None else None)


@dataclass(frozen=True, kw_only=True, slots=True)
class LookupReport:
    """What the client learned from a cluster lookup, sent (without waiting) to the node that owns the
    junction, so that node's policies and metrics see what a single node's lookup would have counted."""

    namespace_id: bytes
    num_tokens: int
    kv_tokens: int
    state_tokens: int
    junction: bytes | None = None  # p(kv_tokens) when it is a checkpoint hint (no snapshot there)
    missing_block: bytes | None = None  # h_{m+1}: the first block of the prompt not stored

    def to_header(self) -> dict[str, object]:
        return {"ns": self.namespace_id, "num_tokens": self.num_tokens, "kv_tokens": self.kv_tokens,
                "state_tokens": self.state_tokens, "junction": self.junction, "missing": self.missing_block}

    @classmethod
    def from_header(cls, h: dict[str, object], limits: Limits) -> LookupReport:
        """Bounded like a lookup (``max_lookup_tokens``): a report feeds counters every tenant's
        dashboards read, so one report may count no more than one lookup could."""
        ns = req_bin(h, "ns", size=NAMESPACE_ID_BYTES)
        n = req_int(h, "num_tokens", hi=limits.max_lookup_tokens)
        kv = req_int(h, "kv_tokens", hi=n)
        return cls(namespace_id=ns, num_tokens=n, kv_tokens=kv, state_tokens=req_int(h, "state_tokens", hi=kv),
                   junction=opt_bin(h, "junction", size=HASH_BYTES), missing_block=opt_bin(h, "missing", size=HASH_BYTES))


__all__ = ["TIER_ELSEWHERE", "LookupReport", "ProbeAnswer", "ProbeRequest", "StopLevel"]
