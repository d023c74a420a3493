"""What a client counts instead of raising: the store is best effort toward the engine.

Every store failure becomes a miss or a dropped save, counted here by operation (``lookup``,
``read``, ``save``, ``quota``, ``checksum``, ``nixl``, ...) and warned about at most once per
``warn_interval_s`` per operation (a dead store must not flood the engine's log).

``lookup`` counts lookups answered short because of a failure, once each: on a cluster, a lookup
none of whose holders of some branch answered (down, failing, or skipped while its circuit
breaker is open); the node errors behind them are counted apart, as ``probe`` (one per error, not
per lookup: while a breaker is open its node is skipped, not asked).
"""

from __future__ import annotations

import collections
import logging
import time

log = logging.getLogger(__name__)


class Failures:
    def __init__(self, warn_interval_s: float, label: str = "prefixstore") -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._warn_interval_s = warn_interval_s
        self._label = label
        self._last_warning: dict[str, float] = {}

    def record(self, op: str, err: BaseException | str) -> None:
        """Count a failure of ``op`` and warn (rate-limited) that it was treated as a miss."""
        self.counts[op] += 1
        now = time.monotonic()
        if now - self._last_warning.get(op, -1e18) >= self._warn_interval_s:
            self._last_warning[op] = now
            log.warning("%s %s failed (%d so far), treated as a miss: %s", self._label, op, self.counts[op], err)

    def count(self, op: str, n: int = 1) -> None:
        """Count without a warning (the failure was warned about under another operation)."""
        self.counts[op] += n


__all__ = ["Failures"]
