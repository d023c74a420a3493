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

w is tuned online from two kinds of evidence, with no grid search at start,
so it follows the traffic as it changes:

- Mistakes (ARC-style ghosts). An evicted entry leaves a ghost; when a lookup
  misses it, the eviction was a mistake, and w moves towards what would have
  kept it: up if the ghost was more FLOP-efficient than the typical victim,
  down if not (its recency was what mattered), by a step weighed by the
  FLOPs the miss cost. Two corrections make the ghosts honest. (1) A chain
  leaves from its end (leaf-first), so a lookup misses its *first* block, by
  itself the least efficient entry of the chain; a ghost therefore carries
  the most valuable entry (V x FLOPs per byte) evicted beneath it (a
  long-context snapshot), and is judged as that. Without this, w fell to ~0 on long single contexts,
  where ranking by efficiency pays most. (2) A miss counts only if some w in
  [0, 1] could have kept the entry until now (the inflation since its
  eviction is within what a different w adds to its priority); a session
  evicted long ago says nothing about w. Without this, every returning
  long session voted for w = 1 in multi-turn chat, where recency pays.
- Uses. A repeat hit on a snapshot more efficient than what its origin
  typically stores raises w; one on a less efficient snapshot lowers it. So
  w follows whether efficiency predicts use on this traffic: in RAG the
  snapshots used again and again are the short shared prefixes (system
  prompt, first document) and w goes to 0; on long contexts they are the
  long prefixes. First hits do not vote: which snapshots live to their first
  use is what w itself decides, so they confirm whatever w is (measured on
  multi-turn chat: w went to 1 and the token hit rate fell).

Renewals are priced. A use of a snapshot at b saves the recompute of b tokens, which the cost
model prices as the KV bytes of those tokens (retention.py: a byte of KV saves
1/kv_bytes_per_token tokens a use); holding the snapshot's S bytes costs what they displace,
S x y, where y is the bytes that lookups later asked for again per byte evicted (the ghosts
below; 0 while nothing has been evicted, about 1 when every evicted byte comes back). A use
renews a snapshot's stay, and counts as a reuse of its origin, only by the share of that price
it pays: min(1, b x kv_bytes_per_token / (S x y)). A snapshot's first stay is judged by its
origin (V) alone: in chat the generation-end snapshot of turn t is used once, by turn t + 1,
and pricing its first stay would rank it below its own KV, which is useless without it. Counted
by hits alone, a snapshot of the first token that every conversation shares (ShareGPT: hit 698
times, saving 698 tokens, 49.5 MiB held) stayed forever under recency, made the junction origin
look like the best one, and with it ranked the generation ends that earn the hits below their
own KV: 0.097 against 0.212 with priced renewals, docs/benchmarks.md. With y in the price and
not a constant, the same snapshot stays where evicted bytes are never asked for again (90% of
the footprint), and costs nothing there.

Each vote moves w by a step that shrinks as votes accumulate, as in
stochastic approximation: ``early_votes`` (K) times ``step`` for the first
vote, step x K / (1 + n/K) for the n-th, never below ``step`` (reached after
K(K - 1) votes, 90 with the defaults; K = 0: a fixed step). While there is little evidence one
vote says a lot about the traffic; later, single votes are noise around a
w already found, and the base step keeps following the traffic as it
changes. With a fixed step of 0.02 the tuner, starting from 0.5, needed
more than 200 long-context requests to reach w ~ 1 (it ended at 0.68 on
the 5%-capacity trace, seed 0); trace length, not evidence, was the limit.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from prefixstore.protocol.keys import Kind
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
    hash_seed: int = 0  # seeds the sighting filters' bit positions; the store draws a secret one


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
    """Per snapshot origin: the decayed share of stored snapshots that got reused.

    An origin seen only a few times is judged by the share over all origins
    (``prior`` snapshots' worth of it), not by a fixed prior: with (reused + 0.5) /
    (stored + 1), a junction origin seen twice and never reused rated 0.17, four times
    the prompt ends that earned every hit on reuse-twice, so the prompt-end
    snapshots ranked below their own KV, left before it, and left that KV unable to
    serve exact reuse (token hit rate 0.019 at 5% of the footprint; 0.056 with LRU)."""

    def __init__(self, half_life: int = 1024, prior: float = 4.0) -> None:
        self.half_life = half_life
        self.prior = prior
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

    def on_first_hit(self, origin: int, share: float = 1.0) -> None:
        """A snapshot of ``origin`` was used for the first time; ``share``: how much of a reuse
        that use counts for (FlopAware.use_pays: the share of the snapshot's price it paid)."""
        self.reused[origin] = self.reused.get(origin, 0.0) + share

    def rate(self, origin: int) -> float:
        overall = (sum(self.reused.values()) + 0.5) / (sum(self.stored.values()) + 1.0)
        return (self.reused.get(origin, 0.0) + self.prior * overall) / (self.stored.get(origin, 0.0) + self.prior)

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


def anchor_key(entry: EntryView) -> bytes | None:
    """The key of what ``entry`` hangs from (a snapshot's block, a block's parent
    block), when the entry exposes it (the store's entries do: ``container``,
    ``parent_key``, both scoped by namespace like ``key``); None for an entry
    that does not say."""
    if entry.kind is Kind.STATE:
        return getattr(entry, "container", None)
    return getattr(entry, "parent_key", None)


class FlopAware:
    name = "flop-aware"

    def __init__(self, context: PolicyContext | None = None, weight: float = 0.5, step: float = 0.02,
                 num_ghosts: int = 8192, tune: bool = True, early_votes: int = 10, half_life: int = 1024) -> None:
        self.context = context or PolicyContext()
        self.weight = weight
        self.step = step
        self.early_votes = early_votes
        self.votes = 0
        self.tune = tune
        self.inflation = 0.0  # L
        self._mean_eff = 0.0
        self._num_eff = 0
        # evicted key -> (FLOPs per byte, FLOPs a hit saves, origin or -1 for KV,
        #                 priority when evicted, the most a different w could add to it,
        #                 V x FLOPs per byte: what a chain's ghost is judged by)
        self._ghosts: OrderedDict[bytes, tuple[float, float, int, float, float, float]] = OrderedDict()
        # entry key of a parent -> the best ghost evicted beneath it, until the parent goes too
        self._carry: OrderedDict[bytes, tuple[float, float, int, float, float, float]] = OrderedDict()
        # The price of space, y (module docstring): evicted bytes and the bytes of those a lookup
        # asked for again, both halved every ``half_life`` evictions (the origin values' 1,024,
        # which count stores). A ghost's bytes are its entry's and those evicted beneath it
        # (handed up like the carry): a lookup that misses a chain's first block wants the chain.
        # Measured whether or not w is tuned: the price is the traffic's, not the tuner's.
        self.half_life = half_life
        self._evicted_bytes = 0.0
        self._reasked_bytes = 0.0
        self._ghost_bytes: OrderedDict[bytes, float] = OrderedDict()
        self._carry_bytes: OrderedDict[bytes, float] = OrderedDict()
        self._ghost_flops = 0.0
        self._num_ghosts = num_ghosts
        self._victim_eff = 0.0
        self._stored_eff: dict[int, float] = {}
        self._stored_n: dict[int, int] = {}
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

    @property
    def evicted_reuse(self) -> float:
        """y: the bytes of evicted entries that lookups asked for again, per byte evicted (0 before
        any eviction; above 1 where what left is asked for more than once)."""
        return self._reasked_bytes / self._evicted_bytes if self._evicted_bytes > 0 else 0.0

    def use_pays(self, entry: EntryView) -> float:
        """The share of a snapshot's price one use pays, in [0, 1]: the KV bytes of the tokens a
        use saves over what the snapshot's bytes displace, min(1, b x kv / (S x y)). 1 for KV (a
        block's use saves its own tokens: its bytes' worth), for an unknown shape, and while
        nothing evicted was asked for again (y = 0: space costs nothing)."""
        y = self.evicted_reuse
        shape = self._shape(entry.namespace_id)
        if entry.kind is not Kind.STATE or shape is None or y <= 0 or entry.size <= 0:
            return 1.0
        return min(1.0, entry.position * shape.kv_bytes_per_token / (entry.size * y))

    def value(self, entry: EntryView) -> float:
        """V: 1 for KV; for a snapshot, the learned reuse value of its origin, and once it has
        been used, times the share of its price a use pays (a use renews it only that far)."""
        if entry.kind is not Kind.STATE:
            return 1.0
        v = self.origins.value(entry.origin)
        return v * self.use_pays(entry) if entry.num_hits > 0 else v

    def priority(self, entry: EntryView, now: float) -> float:
        return self.inflation + self.value(entry) * ((1.0 - self.weight) + self.weight * self.efficiency(entry))

    def _raw_eff(self, entry: EntryView) -> float:
        shape = self._shape(entry.namespace_id)
        return flops_saved(shape, entry) / entry.size if shape is not None and entry.size else 0.0

    def on_store(self, entry: EntryView, now: float) -> None:
        if entry.kind is Kind.STATE:
            self.origins.on_store(entry.origin)
            if self.tune:  # the efficiency typical of what this origin stores
                eff = self._raw_eff(entry)
                n = self._stored_n.get(entry.origin, 0) + 1
                self._stored_n[entry.origin] = min(n, 1000)
                m = self._stored_eff.get(entry.origin, 0.0)
                self._stored_eff[entry.origin] = m + (eff - m) / min(n, 1000)

    def _next_step(self) -> float:
        """The step of this vote: K x step at first, shrinking as 1 / (1 + n/K), at least step."""
        k, n = self.early_votes, self.votes
        self.votes += 1
        return self.step * max(1.0, k / (1.0 + n / k)) if k > 0 else self.step

    def _vote(self, eff: float, origin: int) -> None:
        """A snapshot of this origin was used: if it is more efficient than what the
        origin typically stores, efficiency predicts use (raise w), else lower w."""
        m = self._stored_eff.get(origin)
        if m is None:
            return
        step = self._next_step()
        delta = step if eff > m else -step
        self.weight = min(1.0, max(0.0, self.weight + delta))

    def on_hit(self, entry: EntryView, now: float) -> None:
        if entry.kind is Kind.STATE and entry.num_hits == 0:
            self.origins.on_first_hit(entry.origin, self.use_pays(entry))
        # Repeat uses only: which snapshots live to their *first* use is what w itself
        # decides (a high w keeps long ones, whose first hits would then vote for a
        # high w); a snapshot used again and again is the traffic's hot set.
        if self.tune and entry.kind is Kind.STATE and entry.num_hits > 0:
            self._vote(self._raw_eff(entry), entry.origin)

    def on_evict(self, entry: EntryView, priority: float, now: float) -> None:
        self.inflation = max(self.inflation, priority)
        self._count_evicted_bytes(entry)
        if self.tune:
            shape = self._shape(entry.namespace_id)
            eff = flops_saved(shape, entry) / entry.size if shape is not None and entry.size else 0.0
            # The efficiency typical of what gets evicted (the frontier), not of
            # everything stored: a ghost is judged against its fellow victims.
            self._victim_eff += (eff - self._victim_eff) / 64 if self._victim_eff else eff
            # Eviction is leaf-first, so a chain goes from its end: its snapshot
            # (what made the chain worth keeping), then each block as it becomes
            # a leaf. The next lookup misses the *first* evicted block, which
            # by itself is the least efficient entry of the chain; the mistake
            # was evicting what hung below it. So a ghost carries the most
            # valuable entry evicted beneath it (highest V x FLOPs per byte: a
            # junction snapshot that was reused, not the never-reused prompt
            # end just past it), handed up from child to parent.
            e_norm = eff / self._mean_eff if self._mean_eff > 0 else 1.0
            v = self.value(entry)
            # How much a different w could have raised its priority: towards 1
            # if it is more efficient than the mean, towards 0 if less.
            reach = v * ((1.0 - self.weight) * (e_norm - 1.0) if e_norm > 1.0 else self.weight * (1.0 - e_norm))
            ghost = (eff, eff * entry.size, entry.origin if entry.kind is Kind.STATE else -1, priority, reach, v * eff)
            carried = self._carry.pop(entry.key, None)
            if carried is not None and carried[5] > ghost[5]:
                ghost = carried
            self._ghosts[entry.key] = ghost
            if len(self._ghosts) > self._num_ghosts:
                self._ghosts.popitem(last=False)
            up = anchor_key(entry)
            if up is not None:
                held = self._carry.get(up)
                if held is None or ghost[5] > held[5]:
                    self._carry[up] = ghost
                    self._carry.move_to_end(up)
                    if len(self._carry) > self._num_ghosts:
                        self._carry.popitem(last=False)

    def _count_evicted_bytes(self, entry: EntryView) -> None:
        """y's bookkeeping: the bytes evicted, and the ghost of this entry's chain in bytes."""
        f = 0.5 ** (1.0 / self.half_life)
        self._evicted_bytes = self._evicted_bytes * f + entry.size
        self._reasked_bytes *= f
        chain = entry.size + self._carry_bytes.pop(entry.key, 0.0)
        self._ghost_bytes[entry.key] = chain
        if len(self._ghost_bytes) > self._num_ghosts:
            self._ghost_bytes.popitem(last=False)
        up = anchor_key(entry)
        if up is not None:
            self._carry_bytes[up] = self._carry_bytes.get(up, 0.0) + chain
            if len(self._carry_bytes) > self._num_ghosts:
                self._carry_bytes.popitem(last=False)

    def on_miss(self, kind: Kind, key: bytes, now: float) -> None:
        """A lookup wanted an entry we evicted (or one evicted beneath it). Had it been
        more FLOP-efficient than the typical victim, more weight on efficiency would
        have kept it: raise w. Otherwise only recency could have kept it: lower w.
        A miss no w in [0, 1] could have prevented moves nothing."""
        asked = self._ghost_bytes.pop(bytes((kind,)) + key, None)
        if asked is not None:
            self._reasked_bytes += asked
        if not self.tune:
            return
        ghost = self._ghosts.pop(bytes((kind,)) + key, None)
        if ghost is None:
            return
        eff, flops, _, evicted_at, reach, _ = ghost
        if self.inflation - evicted_at > reach:
            return  # no weight in [0, 1] would have kept it until now: no evidence either way
        # Weigh each mistake by what it cost: missing a long-prefix snapshot loses
        # far more recompute than missing one KV block.
        self._ghost_flops += (flops - self._ghost_flops) / 64 if self._ghost_flops else flops
        size = min(4.0, flops / self._ghost_flops) if self._ghost_flops else 1.0
        step = self._next_step()
        delta = step * size if eff > self._victim_eff else -step * size
        self.weight = min(1.0, max(0.0, self.weight + delta))
