"""The cluster lookup's per-node question and answer (``POST /v1/probe``): one hop of a walk.

A cluster lookup walks the prompt's branches (protocol/placement.py). Each hop asks one node
about the prompt's **levels** from some level s on: level j is the parent hash h_j (h_0 the
root), the prompt's next block h_{j+1} (absent at the last level), the prompt's tokens of that
block [jB, min((j+1)B, T)) and its extra keys. The node answers the levels in order, each with
exactly what a single node's lookup computes there, and stops at the first level that ends its
part:

* ``held``: block h_{j+1} is stored here under h_j -- the node goes on to level j+1, unless
* ``fork``: what is stored here is h_{j+1}'s fork record: the prompt continues on h_{j+1}'s
  branch node, which the client asks next from level j (there the block is held in full). The
  node stops after this level;
* not held: ``child``, the stored child of h_j (block, tail, or another fork head's record) whose
  tokens agree longest with the segment (``usable_tokens`` of them), ends the match. The node stops.
* ``snapshot``: the largest-boundary snapshot registered under h_j whose container agrees with
  the prompt up to its boundary, and whose boundary the KV of this level reaches ((j+1)B when
  h_{j+1} is held, jB + child's usable tokens otherwise).
* ``exact``: this node is the level's home (it holds all of the level), so ``child`` and
  ``snapshot`` are the single-node answer. A node answering a level it is not the home of (a
  branch node confirming its fork head at level s, a node holding hot copies) says so; the client
  asks the home where an exact answer matters (client/cluster.py).

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
from .nixl_wire import NixlPlacements
from .wire import MAX_EXTRA_BYTES, EntryRef, Limits, WireError, opt_bin, req_bin, req_bool, req_int, req_list


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeLevel:
    level: int  # j
    parent: bytes  # h_j (the root at j = 0)
    next: bytes  # h_{j+1}, or b"" at the last level (no full block follows)
    tokens: bytes  # the prompt's tokens [jB, min((j+1)B, T)), packed uint32
    extra: bytes = b""  # the prompt's extra keys of block j+1

    def to_wire(self) -> list[object]:
        return [self.level, self.parent, self.next, self.tokens, self.extra]

    @classmethod
    def from_wire(cls, raw: object, ctx: str, block_tokens: int) -> ProbeLevel:
        if not isinstance(raw, list) or len(raw) != 5:
            raise WireError(ctx, "expected [level, parent, next, tokens, extra]")
        h = dict(zip(("level", "parent", "next", "tokens", "extra"), raw))
        level = h["level"]
        if not isinstance(level, int) or isinstance(level, bool) or level < 0:
            raise WireError(f"{ctx}.level", "expected a non-negative integer")
        parent = req_bin(h, "parent", f"{ctx}.", size=HASH_BYTES)
        nxt = req_bin(h, "next", f"{ctx}.")
        if len(nxt) not in (0, HASH_BYTES):
            raise WireError(f"{ctx}.next", f"expected {HASH_BYTES} bytes or none")
        tokens = req_bin(h, "tokens", f"{ctx}.", multiple=TOKEN_BYTES)
        if len(tokens) // TOKEN_BYTES > block_tokens:
            raise WireError(f"{ctx}.tokens", f"a level holds at most {block_tokens} tokens (one block)")
        if nxt and len(tokens) // TOKEN_BYTES != block_tokens:
            raise WireError(f"{ctx}.tokens", f"a level with a next block holds exactly {block_tokens} tokens")
        extra = req_bin(h, "extra", f"{ctx}.")
        if len(extra) > MAX_EXTRA_BYTES:
            raise WireError(f"{ctx}.extra", f"{len(extra)} bytes, at most {MAX_EXTRA_BYTES}", Problem.TOO_LARGE)
        return cls(level=level, parent=parent, next=nxt, tokens=tokens, extra=extra)


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeRequest:
    namespace_id: bytes
    levels: tuple[ProbeLevel, ...]
    lease: bool = True
    nixl: bool = False  # also answer where the reported payloads lie (as a lookup does; store/nixl_lookup.py)

    def to_header(self) -> dict[str, object]:
        d: dict[str, object] = {"ns": self.namespace_id, "levels": [lv.to_wire() for lv in self.levels],
                                "lease": self.lease}
        if self.nixl:
            d["nixl"] = True
        return d

    @classmethod
    def from_header(cls, h: dict[str, object], limits: Limits,
                    block_tokens_of: Callable[[bytes], int]) -> ProbeRequest:
        ns = req_bin(h, "ns", size=NAMESPACE_ID_BYTES)
        B = block_tokens_of(ns)
        max_levels = limits.max_lookup_tokens // B + 1  # a prompt's levels: its full blocks and one more
        raw = req_list(h, "levels", "", max_levels)
        levels = tuple(ProbeLevel.from_wire(x, f"levels[{i}]", B) for i, x in enumerate(raw))
        # The levels of one prompt from some level on: consecutive, each hanging from the block the
        # one before names, only the last without a next block. (Repeating one level thousands of
        # times made one probe scan its children thousands of times.)
        for i in range(1, len(levels)):
            if levels[i].level != levels[i - 1].level + 1:
                raise WireError(f"levels[{i}].level", "levels must be consecutive")
            if levels[i].parent != levels[i - 1].next:
                raise WireError(f"levels[{i}].parent", "must be the block the level before names as next")
        if any(not lv.next for lv in levels[:-1]):
            raise WireError("levels", "only the last level may have no next block")
        if levels and levels[-1].level >= max_levels:
            raise WireError("levels", f"level {levels[-1].level} is past the longest prompt "
                            f"(max_lookup_tokens={limits.max_lookup_tokens})", Problem.TOO_LARGE)
        if sum(len(lv.tokens) for lv in levels) // TOKEN_BYTES > limits.max_lookup_tokens:
            raise WireError("levels", f"more than {limits.max_lookup_tokens} tokens in all", Problem.TOO_LARGE)
        return cls(namespace_id=ns, levels=levels, lease=req_bool(h, "lease", default=True),
                   nixl=req_bool(h, "nixl", default=False))


TIER_ELSEWHERE = "elsewhere"
"""The tier of a child that is a fork record: its payload is on its branch node."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LevelAnswer:
    level: int
    held: bool
    child: EntryRef | None = None
    snapshot: EntryRef | None = None
    fork: bool = False  # held as a fork record: the prompt continues on h_{j+1}'s branch node
    exact: bool = True  # this node is the level's home: child and snapshot are the single-node answer

    def to_wire(self) -> list[object]:
        return [self.level, self.held, self.child.to_wire() if self.child else None,
                self.snapshot.to_wire() if self.snapshot else None, self.fork, self.exact]

    @classmethod
    def from_wire(cls, raw: object, ctx: str) -> LevelAnswer:
        if not isinstance(raw, list) or len(raw) != 6 or not isinstance(raw[0], int) \
                or not all(isinstance(x, bool) for x in (raw[1], raw[4], raw[5])):
            raise WireError(ctx, "expected [level, held, child, snapshot, fork, exact]")
        return cls(level=raw[0], held=raw[1],
                   child=EntryRef.from_wire(raw[2], f"{ctx}.child") if raw[2] is not None else None,
                   snapshot=EntryRef.from_wire(raw[3], f"{ctx}.snapshot") if raw[3] is not None else None,
                   fork=raw[4], exact=raw[5])


@dataclass(frozen=True, kw_only=True, slots=True)
class ProbeAnswer:
    levels: tuple[LevelAnswer, ...]
    lease_id: bytes | None = None
    lease_ttl_s: float = 0.0
    replicas: dict[bytes, tuple[str, ...]] = field(default_factory=dict)
    nixl: NixlPlacements | None = None  # asked with ``nixl``: placements, as in a LookupAnswer

    def to_header(self) -> dict[str, object]:
        return {"levels": [lv.to_wire() for lv in self.levels], "lease": self.lease_id,
                "lease_ttl_s": self.lease_ttl_s, "replicas": {k.hex(): list(v) for k, v in self.replicas.items()},
                "nixl": self.nixl.to_wire() if self.nixl is not None else None}

    @classmethod
    def from_header(cls, h: dict[str, object]) -> ProbeAnswer:
        raw = req_list(h, "levels", "", 1 << 22)
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
        return cls(levels=tuple(LevelAnswer.from_wire(x, f"levels[{i}]") for i, x in enumerate(raw)),
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


__all__ = ["TIER_ELSEWHERE", "LevelAnswer", "LookupReport", "ProbeAnswer", "ProbeLevel", "ProbeRequest"]
