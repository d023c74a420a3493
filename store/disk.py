"""The store's side of the LMDB tier: whether there is one, what is still to delete from it, and
how the store recovers when LMDB reports damage.

Deletions from the index are collected (``doom``) and written in the next write transaction or
by the sweeper (``flush``), never one transaction per entry. When a write meets damage
(:class:`TierDamaged`) the tier is reset: the store drops every entry from its index (all were
written through, so none would survive), the environment is set aside, and the registered
namespaces are written to the new one. ``epoch`` counts resets, so a write that was in flight
across one is known to have gone to the environment set aside.

**A full disk is back-pressure, not damage** (:class:`TierFull`): the transaction that met it
wrote nothing, and everything committed before is intact. The tier is marked ``full`` (an error
line, ``prefixstore_lmdb_full`` = 1); for ``FULL_RETRY_S`` after each failure writes are refused
without being tried (``refusing``: a sync commit is rejected at once, store/writes.py), then the
next write tries again, and the first that succeeds clears it (a line saying writes resumed).
Deletions owed to the tier wait, and namespace registrations are refused (503) meanwhile. The
write-behind keeps its queue in RAM and retries (store/behind.py).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable, Iterable, Sequence

from prefixstore.protocol.errors import Problem, Reason
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import WireError
from .config import StoreConfig
from .lmdb_tier import LmdbTier, Scan, StoredRecord, TierDamaged, TierFull
from .metrics import StoreMetrics

log = logging.getLogger(__name__)

FULL_RETRY_S = 1.0
"""After a write met a full disk, how long writes are refused before the next one tries again."""
DISK_FULL = Reason.DISK_FULL.text
"""What a request refused for the full disk says (its items say ``Reason.DISK_FULL``)."""


class Disk:
    def __init__(self, config: StoreConfig, metrics: StoreMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self.tier: LmdbTier | None = None
        self._doomed: list[bytes] = []  # deleted from the index, still to delete from LMDB
        # Bound by the store once its parts exist (store/core.py):
        self._drop_all: Callable[[str], int] = lambda reason: 0
        self._namespaces: Callable[[], Iterable[Namespace]] = lambda: ()
        self.full_since: float | None = None  # time.monotonic() of the first write that found the disk full
        self._retry_at = 0.0

    def bind(self, drop_all: Callable[[str], int], namespaces: Callable[[], Iterable[Namespace]]) -> None:
        """What a reset needs of the store: drop every entry (returns how many), and the namespaces."""
        self._drop_all = drop_all
        self._namespaces = namespaces

    @property
    def enabled(self) -> bool:
        return self.tier is not None

    @property
    def full(self) -> bool:
        """Whether the last write met a full disk (and none succeeded since)."""
        return self.full_since is not None

    def refusing(self) -> bool:
        """Whether writes are refused without being tried (within FULL_RETRY_S of a full disk)."""
        return self.full_since is not None and time.monotonic() < self._retry_at

    def _filled(self, err: TierFull) -> None:
        now = time.monotonic()
        self._retry_at = now + FULL_RETRY_S
        self._metrics.lmdb_full_writes.inc()
        if self.full_since is not None:
            return
        self.full_since = now
        where = self.tier.path if self.tier is not None else self._config.lmdb_path
        try:
            usage = shutil.disk_usage(str(where))
            space = f"{usage.free} of {usage.total} bytes free"
        except OSError:
            space = "free space unknown"
        log.error("LMDB tier at %s: a write found the disk full (%s; %s): nothing was lost, writes stop and are "
                  "tried again every %gs; commits are refused while it lasts (durability=write-behind: once "
                  "write_behind_s/write_behind_bytes are behind)", where, err, space, FULL_RETRY_S)

    def _wrote(self) -> None:
        if self.full_since is not None:
            log.warning("LMDB tier at %s: writes resumed after %.1fs of a full disk", self.tier.path if self.tier
                        else "", time.monotonic() - self.full_since)
            self.full_since = None

    @property
    def epoch(self) -> int:
        return self.tier.epoch if self.tier is not None else 0

    def open(self) -> None:
        path = self._config.lmdb_path
        if path is None:
            return
        self.tier = LmdbTier(path, self._config.disk_bytes, sync=self._config.lmdb_sync,
                             max_pins=self._config.nixl_map_txns, keep_damaged=self._config.keep_damaged_lmdb)
        for _ in self.tier.resets:  # set aside while opening: counted like any reset
            self._metrics.lmdb_resets.inc()

    async def close(self) -> None:
        if self.tier is not None:
            await self.flush()
            self.tier.close()
            self.tier = None

    def doom(self, key: bytes) -> None:
        if self.tier is not None:
            self._doomed.append(key)

    async def scan(self) -> Scan:
        assert self.tier is not None
        return await asyncio.to_thread(self.tier.scan)

    async def write(self, puts: Sequence[tuple[StoredRecord, Sequence[memoryview]]]) -> bool:
        """Persist records with their payloads (and what is doomed), in one transaction. False when
        they are not on disk afterwards because the tier was reset (damage met by this write or by
        another one meanwhile): the caller must not index them. :class:`TierFull` when the disk
        took none of it (the tier is marked full); other errors are raised too. Either way what
        was doomed stays doomed."""
        assert self.tier is not None
        doomed, self._doomed = self._doomed, []
        epoch = self.tier.epoch
        try:
            await self.tier.write(puts, doomed)
        except TierDamaged as err:
            if self.tier.epoch == epoch:  # not already reset under this write
                await self.reset(f"write failed: {err}")
            return False
        except TierFull as err:
            self._doomed.extend(doomed)
            self._filled(err)
            raise
        except BaseException:
            self._doomed.extend(doomed)
            raise
        self._wrote()
        return self.tier.epoch == epoch

    async def flush(self) -> None:
        """Delete from LMDB what was deleted from the index (the sweeper also does it each second)."""
        if self.tier is None or not self._doomed:
            return
        doomed, self._doomed = self._doomed, []
        epoch = self.tier.epoch
        try:
            await self.tier.delete(doomed)
            self._wrote()
        except TierDamaged as err:
            if self.tier.epoch == epoch:
                await self.reset(f"delete failed: {err}")
        except TierFull as err:  # tried again by the sweeper
            self._doomed.extend(doomed)
            self._filled(err)
        except Exception:  # never raised into a request (a read that found damage calls this)
            log.exception("LMDB delete of %d entries failed; retried by the sweeper", len(doomed))
            self._doomed.extend(doomed)

    async def put_namespace(self, ns: Namespace) -> None:
        """Persist a namespace record; a damaged tier is reset (which writes every namespace again)."""
        if self.tier is None:
            return
        if self.refusing():
            raise WireError("disk", DISK_FULL, Problem.UNAVAILABLE)
        try:
            await self.tier.put_namespace(ns.id, ns.encode())
            self._wrote()
        except TierDamaged as err:
            await self.reset(f"namespace write failed: {err}")
        except TierFull as err:  # its entries would not survive a restart without it: refused, 503
            self._filled(err)
            raise WireError("disk", DISK_FULL, Problem.UNAVAILABLE) from None

    async def reset(self, reason: str) -> None:
        """LMDB met damage it cannot work around: drop every entry, set the environment aside and go
        on empty. Loud: error log lines and ``prefixstore_lmdb_resets_total``."""
        assert self.tier is not None
        dropped = self._drop_all("damaged")
        self._doomed.clear()
        self._metrics.lmdb_resets.inc()
        await self.tier.reset(reason)
        log.error("LMDB tier reset (%s): %d entries dropped; serving on from an empty tier", reason, dropped)
        for ns in list(self._namespaces()):
            try:
                await self.tier.put_namespace(ns.id, ns.encode())
            except Exception:  # a namespace that is not persisted is registered again by its client
                log.exception("re-writing namespace %s after the LMDB reset failed", ns.id.hex())


__all__ = ["DISK_FULL", "FULL_RETRY_S", "Disk"]
