"""Admission policies: which offered entries the store takes (DESIGN §6).

Hooks the store calls (all pure bookkeeping, time passed in):

- ``admit(kind, key, size, now)``: an offer (or a put not preceded by one);
- ``on_sighting(kind, key, now)``: a lookup reached a junction with KV but no
  snapshot — the prefix was stored once and is asked for again;
- ``on_hit(kind, key, first, now)``: a lookup served this entry (``first``:
  for the first time);
- ``on_evict(kind, num_hits, now)``: an entry of this kind left the store.
"""

from __future__ import annotations

from ..protocol.keys import Kind
from .sighting import SightingFilter

DEFAULT_FILTER_BYTES = 1 << 20


class AlwaysAdmit:
    """Take every valid offer (the baseline, and the right choice for KV)."""

    name = "always"

    def admit(self, kind: Kind, key: bytes, size: int, now: float) -> bool:
        return True

    def on_sighting(self, kind: Kind, key: bytes, now: float) -> None:
        pass

    def on_hit(self, kind: Kind, key: bytes, first: bool, now: float) -> None:
        pass

    def on_evict(self, kind: Kind, num_hits: int, now: float) -> None:
        pass


class SecondHit(AlwaysAdmit):
    """Cache on the second sighting (Marconi): the first offer of a key is only
    remembered, a later offer or a lookup sighting of it admits it. One-off
    prefixes never take space; every reused prefix forfeits exactly one hit."""

    name = "second-hit"

    def __init__(self, filter_bytes: int = DEFAULT_FILTER_BYTES) -> None:
        self.seen = SightingFilter(filter_bytes)

    def admit(self, kind: Kind, key: bytes, size: int, now: float) -> bool:
        if key in self.seen:
            return True
        self.seen.add(key)
        return False

    def on_sighting(self, kind: Kind, key: bytes, now: float) -> None:
        self.seen.add(key)


class Adaptive(SecondHit):
    """Second-hit when reuse is heavy-tailed and capacity is scarce, always otherwise.

    It measures, online and under whichever mode it is in, the hits that
    second-hit forfeits (F: under always, each entry's first hit; under
    second-hit, each second sighting of a key it turned away) against the hits
    both modes earn (R: every later hit). With every prefix reused exactly twice
    R stays 0 and F/(F+R) = 1, so it admits always instead of collecting
    nothing; on heavy-tailed reuse F/(F+R) is small and one-off prefixes are
    kept out. With no evictions (capacity to spare) one-offs cost nothing, so
    it admits always as well. Counters decay by half every ``window`` events.
    """

    name = "adaptive"

    def __init__(self, filter_bytes: int = DEFAULT_FILTER_BYTES, window: int = 256,
                 forfeit_threshold: float = 0.5) -> None:
        super().__init__(filter_bytes)
        self.window = window
        self.forfeit_threshold = forfeit_threshold
        self.forfeited = 0.0
        self.repeat_hits = 0.0
        self.evictions = 0.0
        self.events = 0
        self.always_mode = True  # start generous: no evidence yet that space is scarce

    def _tick(self) -> None:
        self.events += 1
        if self.events >= self.window:
            self.forfeited /= 2
            self.repeat_hits /= 2
            self.evictions /= 2
            self.events = 0
        self._decide()

    def _decide(self) -> None:
        total = self.forfeited + self.repeat_hits
        if self.evictions < 1.0:
            self.always_mode = True  # nothing is being pushed out: one-offs are free
        elif total >= 4.0:
            self.always_mode = self.forfeited / total >= self.forfeit_threshold

    @property
    def forfeit_fraction(self) -> float:
        total = self.forfeited + self.repeat_hits
        return self.forfeited / total if total else 0.0

    def admit(self, kind: Kind, key: bytes, size: int, now: float) -> bool:
        seen = key in self.seen
        if seen:
            # A key turned away before is offered again: 'always' would have had a hit.
            self.forfeited += 1
            self._tick()
            return True
        self.seen.add(key)
        self._tick()
        return self.always_mode

    def on_hit(self, kind: Kind, key: bytes, first: bool, now: float) -> None:
        if first and self.always_mode:
            self.forfeited += 1  # second-hit would have had nothing stored yet
        else:
            self.repeat_hits += 1
        self._tick()

    def on_evict(self, kind: Kind, num_hits: int, now: float) -> None:
        self.evictions += 1
        self._tick()
