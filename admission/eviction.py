"""Eviction priorities (lower goes first), for both memory shapes in one byte budget.

The store keeps candidates in a heap keyed by ``priority``, computed when an
entry is stored or read, and enforces leases and leaf-first deletion whatever
the policy says.

``flop-aware`` is GreedyDual-style: priority = L + (1 - w) + w * E, where L is
the priority of the last entry evicted (so anything touched later ranks above
everything untouched since: recency), and E is the entry's recompute FLOPs
saved per byte held, normalised by its running mean (so E ~ 1 and the two
terms are comparable). w = 0 is LRU; w = 1 ranks purely by FLOPs per byte.

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

    def on_evict(self, entry: EntryView, priority: float, now: float) -> None:
        pass

    def on_miss(self, kind: Kind, key: bytes, now: float) -> None:
        pass


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
        self._ghosts: OrderedDict[bytes, float] = OrderedDict()
        self._num_ghosts = num_ghosts
        self._fallback: dict[bytes, ModelShape] = {}

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

    def priority(self, entry: EntryView, now: float) -> float:
        return self.inflation + (1.0 - self.weight) + self.weight * self.efficiency(entry)

    def on_evict(self, entry: EntryView, priority: float, now: float) -> None:
        self.inflation = max(self.inflation, priority)
        if self.tune:
            shape = self._shape(entry.namespace_id)
            eff = flops_saved(shape, entry) / entry.size if shape is not None and entry.size else 0.0
            self._ghosts[entry.key] = eff / self._mean_eff if self._mean_eff > 0 else 1.0
            if len(self._ghosts) > self._num_ghosts:
                self._ghosts.popitem(last=False)

    def on_miss(self, kind: Kind, key: bytes, now: float) -> None:
        if not self.tune:
            return
        ghost = self._ghosts.pop(bytes((kind,)) + key, None)
        if ghost is None:
            return
        delta = self.step if ghost > 1.0 else -self.step
        self.weight = min(0.95, max(0.05, self.weight + delta))
