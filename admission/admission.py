"""Admission policies: which offered entries the store takes (DESIGN §6).

Hooks the store calls (all pure bookkeeping, time passed in):

- ``admit(kind, key, size, now, origin)``: an offer (or a put not preceded by one);
- ``on_sighting(kind, key, now)``: a lookup reached a junction with KV but no
  snapshot — the prefix was stored once and is asked for again;
- ``on_hit(kind, key, first, now)``: a lookup served this entry (``first``:
  for the first time);
- ``on_evict(kind, num_hits, now)``: an entry of this kind left the store.
"""

from __future__ import annotations

from prefixstore.protocol.keys import Kind
from .sighting import SightingFilter

DEFAULT_FILTER_BYTES = 1 << 20


class AlwaysAdmit:
    """Take every valid offer (the baseline, and the right choice for KV)."""

    name = "always"

    def admit(self, kind: Kind, key: bytes, size: int, now: float, origin: int = 0) -> bool:
        return True

    def on_sighting(self, kind: Kind, key: bytes, now: float) -> None:
        pass

    def on_hit(self, kind: Kind, key: bytes, first: bool, now: float, origin: int = 0) -> None:
        pass

    def on_evict(self, kind: Kind, num_hits: int, now: float, origin: int = 0) -> None:
        pass


class SecondHit(AlwaysAdmit):
    """Cache on the second sighting (Marconi): the first offer of a key is only
    remembered, a later offer or a lookup sighting of it admits it. One-off
    prefixes never take space; every reused prefix forfeits exactly one hit."""

    name = "second-hit"

    def __init__(self, filter_bytes: int = DEFAULT_FILTER_BYTES, seed: int = 0) -> None:
        self.seen = SightingFilter(filter_bytes, seed)

    def admit(self, kind: Kind, key: bytes, size: int, now: float, origin: int = 0) -> bool:
        if key in self.seen:
            return True
        self.seen.add(key)
        return False

    def on_sighting(self, kind: Kind, key: bytes, now: float) -> None:
        self.seen.add(key)


class Adaptive(SecondHit):
    """Always, unless the traffic shows second-hit would keep nearly all the hits
    while always fills the cache with snapshots nobody reuses.

    Measured online, in whichever mode it is in:

    - F, hits second-hit forfeits: under always, each snapshot's *first* hit
      (second-hit would only have stored it then); under second-hit, each
      re-offer of a key it turned away;
    - R, hits both modes earn: under always, every later hit; under
      second-hit, every hit;
    - waste: the share of evicted snapshots that were never reused.

    Per origin (prompt end, generation end, junction, periodic), it also
    learns the share of *evicted* snapshots that had been reused at all; an
    origin whose snapshots are reused far less often than the best origin's
    (< ``dead_origin_rate`` times its rate, over at least
    ``dead_origin_samples`` evictions: prompt ends in multi-turn chat, where
    the next turn replays the answer too) is admitted on second sighting
    whatever the mode, so it stops taking space without costing the origins
    that pay. Relative, because in a small cache every origin's rate is low,
    and an absolute floor then shuts out the one origin that earns the few
    hits there are. A snapshot is judged once its outcome is known: reused at
    its first hit, unreused when it is evicted without one. Judging at
    eviction, not at admission, gives every snapshot its full stay to be
    reused first (reuse that comes late is still counted); judging a reused
    one at its first hit tells early what the *best* origin is worth. Before,
    that waited for reused snapshots to be evicted too, and on long contexts
    the junction snapshots that pay stay for dozens of requests: meanwhile
    the one-off question and answer snapshots kept being admitted (66 of
    each at 15% capacity, seed 0).

    Under always it moves to second-hit when reuse is heavy-tailed (F/(F+R) <
    ``enter_below``: most hits are repeat hits of a few hot prefixes) *and*
    most evictions are of never-reused snapshots (capacity is being spent on
    one-offs). Under second-hit it returns to always as soon as F/(F+R) rises
    above ``leave_above`` — with every prefix reused exactly twice R stays 0
    and it returns at once instead of collecting nothing — or when nothing is
    being evicted any more. Counters restart at each switch, so each mode is
    judged on its own evidence.
    """

    name = "adaptive"

    def __init__(self, filter_bytes: int = DEFAULT_FILTER_BYTES, min_events: int = 64,
                 enter_below: float = 0.2, leave_above: float = 0.35, min_waste: float = 0.5,
                 dead_origin_rate: float = 0.05, dead_origin_samples: float = 16.0, seed: int = 0) -> None:
        super().__init__(filter_bytes, seed)
        # Keys admitted when offered again (after an eviction): a returning prefix.
        self.readmitted = SightingFilter(max(16, filter_bytes // 4), seed=seed)
        self.offers = {False: 0.0, True: 0.0}  # admitted on a first offer / on a re-offer
        self.offers_reused = {False: 0.0, True: 0.0}  # ... and reused since
        self._evicted: dict[int, float] = {}
        self._evicted_reused: dict[int, float] = {}
        self._live_reused: dict[int, float] = {}  # reused at least once, not evicted yet
        self.dead_origin_rate = dead_origin_rate
        self.dead_origin_samples = dead_origin_samples
        self.min_events = min_events
        self.enter_below = enter_below
        self.leave_above = leave_above
        self.min_waste = min_waste
        self.always_mode = True
        self._reset()

    def _reset(self) -> None:
        self.forfeited = 0.0
        self.repeat_hits = 0.0
        self.evictions = 0.0
        self.wasted = 0.0

    @property
    def forfeit_fraction(self) -> float:
        total = self.forfeited + self.repeat_hits
        return self.forfeited / total if total else 0.0

    def _decide(self) -> None:
        hits = self.forfeited + self.repeat_hits
        if hits < self.min_events:
            return
        f = self.forfeit_fraction
        if self.always_mode:
            waste = self.wasted / self.evictions if self.evictions else 0.0
            if f < self.enter_below and self.evictions >= self.min_events and waste >= self.min_waste:
                self.always_mode = False
                self._reset()
        elif f > self.leave_above or self.evictions < 1.0:
            self.always_mode = True
            self._reset()
        else:  # keep judging on recent evidence
            self.forfeited /= 2
            self.repeat_hits /= 2
            self.evictions /= 2
            self.wasted /= 2

    def _reuse_rate(self, origin: int) -> float | None:
        """The share of this origin's judged snapshots that were reused (None: too few yet).

        Judged: evicted, or still held and already reused (its outcome is known)."""
        live = self._live_reused.get(origin, 0.0)
        n = self._evicted.get(origin, 0.0) + live
        return (self._evicted_reused.get(origin, 0.0) + live) / n if n >= self.dead_origin_samples else None

    def origin_is_dead(self, origin: int) -> bool:
        """Its snapshots are reused far less often than the best origin's.

        Relative, not absolute: all snapshots cost the same bytes, so an origin
        reused 20x less often than another only displaces better ones. When
        the cache is small, every origin's reuse rate is low (a few percent);
        an absolute threshold would then shut out the very origin that earns
        the few hits there are (reuse-twice at 5% of its footprint)."""
        rate = self._reuse_rate(origin)
        if origin == 0 or rate is None:
            return False
        origins = self._evicted.keys() | self._live_reused.keys()
        best = max((r for o in origins if (r := self._reuse_rate(o)) is not None), default=0.0)
        return rate < self.dead_origin_rate * best

    def reoffers_are_dead(self) -> bool:
        """Snapshots admitted again after an eviction are reused far less often than
        first offers (< ``dead_origin_rate`` times their rate, over at least
        ``dead_origin_samples`` re-admissions).

        When every prompt is sent exactly twice, a snapshot offered again is the
        second send's, after the first send's was evicted, and there is no third
        send: re-admitting it only takes space from prompts still waiting for their
        second send (reuse-twice at 5% of its footprint: 0.054 -> see
        docs/benchmarks.md). Under heavy-tailed reuse a returning prefix is a
        popular one and is reused at least as often as a first offer, so it stays."""
        n = self.offers[True]
        if n < self.dead_origin_samples or self.offers[False] < self.dead_origin_samples:
            return False
        first_rate = self.offers_reused[False] / self.offers[False]
        return self.offers_reused[True] / n < self.dead_origin_rate * first_rate

    def _count_offer(self, again: bool, key: bytes) -> None:
        self.offers[again] += 1.0
        if again:
            self.readmitted.add(key)
        if self.offers[again] > 256:  # decay: the traffic may change
            self.offers[again] /= 2
            self.offers_reused[again] /= 2

    def admit(self, kind: Kind, key: bytes, size: int, now: float, origin: int = 0) -> bool:
        if key in self.seen:
            if not self.always_mode:
                self.forfeited += 1  # turned away before: always would have had a hit
                self._decide()
            elif self.reoffers_are_dead():
                return False
            self._count_offer(True, key)
            return True
        self.seen.add(key)
        if self.always_mode and not self.origin_is_dead(origin):
            self._count_offer(False, key)
            return True
        return False

    def on_hit(self, kind: Kind, key: bytes, first: bool, now: float, origin: int = 0) -> None:
        if first:
            self._live_reused[origin] = self._live_reused.get(origin, 0.0) + 1.0
            self.offers_reused[key in self.readmitted] += 1.0
        if first and self.always_mode:
            self.forfeited += 1  # second-hit would not have stored it yet
        else:
            self.repeat_hits += 1
        self._decide()

    def on_evict(self, kind: Kind, num_hits: int, now: float, origin: int = 0) -> None:
        self.evictions += 1
        self.wasted += num_hits == 0
        if num_hits > 0 and self._live_reused.get(origin, 0.0) >= 1.0:
            self._live_reused[origin] -= 1.0  # judged at its first hit; from now on an evicted one
        n = self._evicted.get(origin, 0.0) + 1.0
        reused = self._evicted_reused.get(origin, 0.0) + (num_hits > 0)
        if n > 256:  # decay: the traffic may change
            n, reused = n / 2, reused / 2
        self._evicted[origin], self._evicted_reused[origin] = n, reused
