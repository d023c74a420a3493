"""Eviction priorities (lower goes first), for both memory shapes in one byte budget.

The store keeps candidates in a heap keyed by ``priority``, computed when an
entry is stored or read, and enforces leases and leaf-first deletion whatever
the policy says.

``flop-aware`` is GreedyDual-style: priority = L + V * ((1 - w) + w * E), where
L is the priority of the last entry evicted (so anything touched later ranks
above everything untouched since: recency), E is the entry's recompute FLOPs
saved per byte held, normalised by its running mean (so E ~ 1 and the two
terms are comparable), and V is the learned value of the entry's class: for a
snapshot, the share of snapshots of its origin (prompt end, generation end,
junction, periodic) that got reused at all, relative to the best origin; for
KV, 1. w = 0 and V = 1 is LRU; w = 1 ranks purely by FLOPs per byte.

Why V: which boundaries pay off depends on the traffic, and the engine cannot
know. In multi-turn chat the next turn replays prompt + answer, so the
generation-end snapshot is reused and the prompt-end one (same conversation,
shorter) almost never is; when the same prompt is sent twice (retries,
several samples) it is the other way round. V learns that on the live
traffic and lets the never-reused class go first.

w is tuned online, ARC-style: evicted entries leave a ghost (their E); when a
lookup misses a ghost, the eviction was a mistake, and w moves towards what
would have kept it — up if the ghost was efficient (E > 1), down if it was not
(then its recency was what mattered). No grid search at start, and it follows
the traffic as it changes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ..protocol.keys import Kind
from .model_shape import ModelShape


class EntryView(Protocol):
    """What a policy may read of an entry (the store's Entry satisfies it)."""

    @property
    def key(self) -> bytes: ...
    @property
    def kind(self) -> Kind: ...
    @property
    def namespace_id(self) -> bytes: ...
    @property
    def size(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def position(self) -> int: ...
    @property
    def last_access_s(self) -> float: ...
    @property
    def num_hits(self) -> int: ...
    @property
    def origin(self) -> int: ...


ShapeOf = Callable[[bytes], "ModelShape | None"]


@dataclass(frozen=True, kw_only=True)
class PolicyContext:
    """What policies may know of the store: model shapes by namespace id, memory for filters."""

    shape_of: ShapeOf = lambda ns_id: None  # noqa: E731
    filter_bytes: int = 1 << 20


class LRU:
    """Least recently used first: priority is the time of the last store or read."""

    name = "lru"

    def __init__(self, context: PolicyContext | None = None) -> None:
        pass

    def priority(self, entry: EntryView, now: float) -> float:
        return entry.last_access_s

    def on_store(self, entry: EntryView, now: float) -> None:
        pass

    def on_hit(self, entry: EntryView, now: float) -> None:
        pass

    def on_evict(self, entry: EntryView, priority: float, now: float) -> None:
        pass

    def on_miss(self, kind: Kind, key: bytes, now: float) -> None:
        pass


class OriginValue:
    """Per snapshot origin: the decayed share of stored snapshots that got reused."""

    def __init__(self, half_life: int = 1024) -> None:
        self.half_life = half_life
        self.stored: dict[int, float] = {}
        self.reused: dict[int, float] = {}
        self._events = 0

    def on_store(self, origin: int) -> None:
        self.stored[origin] = self.stored.get(origin, 0.0) + 1.0
        self._events += 1
        if self._events >= self.half_life:
            self._events = 0
            for d in (self.stored, self.reused):
                for k in d:
                    d[k] /= 2

    def on_first_hit(self, origin: int) -> None:
        self.reused[origin] = self.reused.get(origin, 0.0) + 1.0

    def rate(self, origin: int) -> float:
        return (self.reused.get(origin, 0.0) + 0.5) / (self.stored.get(origin, 0.0) + 1.0)

    def value(self, origin: int) -> float:
        """This origin's reuse rate over the best origin's, in (0, 1]."""
        best = max((self.rate(o) for o in self.stored), default=1.0)
        return min(1.0, self.rate(origin) / best) if best > 0 else 1.0


def flops_saved(shape: ModelShape, entry: EntryView) -> float:
    """Recompute an entry saves when it is hit.

    KV of tokens [s, e): computing those tokens given the prefix. A snapshot
    at b: the whole prefix [0, b), since without it exact reuse of that prefix
    is impossible (the engine would replay from an earlier snapshot or from
    scratch) — which is why long-prefix snapshots are worth their bytes."""
    if entry.kind is Kind.STATE:
        return shape.prefill_flops(entry.position)
    return shape.segment_flops(entry.position - entry.num_tokens, entry.position)


class FlopAware:
    name = "flop-aware"

    def __init__(self, context: PolicyContext | None = None, weight: float = 0.5, step: float = 0.02,
                 num_ghosts: int = 8192, tune: bool = True) -> None:
        self.context = context or PolicyContext()
        self.weight = weight
        self.step = step
        self.tune = tune
        self.inflation = 0.0  # L
        self._mean_eff = 0.0
        self._num_eff = 0
        # evicted key -> (its FLOPs per byte, the FLOPs a hit on it saves)
        self._ghosts: OrderedDict[bytes, tuple[float, float]] = OrderedDict()
        self._ghost_flops = 0.0
        self._num_ghosts = num_ghosts
        self._victim_eff = 0.0
        self.origins = OriginValue()

    def _shape(self, ns_id: bytes) -> ModelShape | None:
        return self.context.shape_of(ns_id)

    def efficiency(self, entry: EntryView) -> float:
        """E: FLOPs saved per byte, over the running mean (1.0 when the shape is unknown)."""
        shape = self._shape(entry.namespace_id)
        if shape is None or entry.size <= 0:
            return 1.0
        eff = flops_saved(shape, entry) / entry.size
        self._num_eff = min(self._num_eff + 1, 10_000)
        self._mean_eff += (eff - self._mean_eff) / self._num_eff
        return eff / self._mean_eff if self._mean_eff > 0 else 1.0

    def value(self, entry: EntryView) -> float:
        """V: 1 for KV, the learned reuse value of its origin for a snapshot."""
        return self.origins.value(entry.origin) if entry.kind is Kind.STATE else 1.0

    def priority(self, entry: EntryView, now: float) -> float:
        return self.inflation + self.value(entry) * ((1.0 - self.weight) + self.weight * self.efficiency(entry))

    def on_store(self, entry: EntryView, now: float) -> None:
        if entry.kind is Kind.STATE:
            self.origins.on_store(entry.origin)

    def on_hit(self, entry: EntryView, now: float) -> None:
        if entry.kind is Kind.STATE and entry.num_hits == 0:
            self.origins.on_first_hit(entry.origin)

    def on_evict(self, entry: EntryView, priority: float, now: float) -> None:
        self.inflation = max(self.inflation, priority)
        if self.tune:
            shape = self._shape(entry.namespace_id)
            eff = flops_saved(shape, entry) / entry.size if shape is not None and entry.size else 0.0
            # The efficiency typical of what gets evicted (the frontier), not of
            # everything stored: a ghost is judged against its fellow victims.
            self._victim_eff += (eff - self._victim_eff) / 64 if self._victim_eff else eff
            self._ghosts[entry.key] = (eff, eff * entry.size)
            if len(self._ghosts) > self._num_ghosts:
                self._ghosts.popitem(last=False)

    def on_miss(self, kind: Kind, key: bytes, now: float) -> None:
        """A lookup wanted an entry we evicted. Had it been more FLOP-efficient than
        the typical victim, more weight on efficiency would have kept it: raise w.
        Otherwise only recency could have kept it: lower w."""
        if not self.tune:
            return
        ghost = self._ghosts.pop(bytes((kind,)) + key, None)
        if ghost is None:
            return
        eff, flops = ghost
        # Weigh each mistake by what it cost: missing a long-prefix snapshot loses
        # far more recompute than missing one KV block.
        self._ghost_flops += (flops - self._ghost_flops) / 64 if self._ghost_flops else flops
        size = min(4.0, flops / self._ghost_flops) if self._ghost_flops else 1.0
        delta = self.step * size if eff > self._victim_eff else -self.step * size
        self.weight = min(1.0, max(0.0, self.weight + delta))
