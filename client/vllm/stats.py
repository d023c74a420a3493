"""The connector's counters (vLLM's ``KVConnectorStats``) and their Prometheus face."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig

STAT_KEYS = ("lookups", "lookup_failures", "lookup_timeouts", "lookups_deferred", "query_tokens", "kv_hit_tokens", "state_hit_tokens", "loaded_tokens",
             "load_failures", "loaded_bytes", "saves", "saved_items", "saved_bytes", "dropped_items", "saves_dropped",
             "skipped_requests", "save_waits", "save_waits_ended", "junction_stops", "junctions_off_grid", "snapshots_withheld",
             "loads_skipped", "lookups_skipped", "saves_skipped", "loads_remeasured", "commit_waits",
             "commit_wait_timeouts", "commit_wait_polls", "commit_wait_ms", "pd_namespace_mismatches")

#: The counters ``prefixstore_vllm_events_total{event=...}`` carries (the rest are tokens and bytes).
EVENT_KEYS = ("lookups", "lookup_failures", "lookup_timeouts", "lookups_deferred", "load_failures", "saves", "saved_items", "dropped_items", "saves_dropped",
              "skipped_requests", "save_waits", "save_waits_ended", "junction_stops", "junctions_off_grid",
              "snapshots_withheld", "loads_skipped", "lookups_skipped", "saves_skipped", "loads_remeasured", "commit_waits", "commit_wait_timeouts", "commit_wait_polls",
              "pd_namespace_mismatches")


#: The cost figures a load decision used (client/vllm/costs.py), in microseconds, reported with the
#: decision: the latest value wins in a report (not a sum), and is exported as a gauge.
COST_KEYS = {"cost_us:prefill_per_token": "prefill_per_token", "cost_us:decode_step": "decode_step",
             "cost_us:load_per_token": "load_per_token", "cost_us:load_fixed": "load_fixed",
             "cost_us:wait_per_token": "wait_per_token", "cost_us:wait_fixed": "wait_fixed"}


#: Batch sizes (requests) of a decode step, in the buckets the step-time counters use.
BATCH_BUCKETS: tuple[tuple[int, int, str], ...] = ((1, 1, "1"), (2, 2, "2"), (3, 4, "3-4"), (5, 8, "5-8"),
                                                  (9, 16, "9-16"), (17, 1 << 30, "17+"))


def decode_step_keys(batch: int, loading: bool) -> tuple[str, str]:
    """The stats keys counting decode steps of ``batch`` requests (and their microseconds), with a
    load in flight or without: what a load costs the requests that are decoding beside it."""
    label = next(name for lo, hi, name in BATCH_BUCKETS if lo <= batch <= hi)
    flag = "yes" if loading else "no"
    return f"decode_steps:{flag}:{label}", f"decode_step_us:{flag}:{label}"


@dataclass
class PrefixStoreStats(KVConnectorStats):
    """Counters since the last report. KV and state hits are separate: the failure signature
    operators look for is a healthy KV hit rate with a collapsed state hit rate (DESIGN §10)."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def reset(self) -> None:
        self.data = {key: 0 for key in STAT_KEYS}

    def set(self, key: str, value: int) -> None:
        self.data[key] = value

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = value if key in COST_KEYS else self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        if self.data["query_tokens"]:
            out["kv_hit_rate"] = round(self.data["kv_hit_tokens"] / self.data["query_tokens"], 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PrefixStorePromMetrics(KVConnectorPromMetrics):
    """``prefixstore_vllm_*_total`` counters per engine (vLLM adds its model/engine labels)."""

    _collectors: ClassVar[list[Any]] = []
    """The counters the last instance in this process registered. vLLM builds this object once per
    engine and, before it registers its own metrics, unregisters the ``vllm:`` ones an earlier
    engine in the process left (``unregister_vllm_metrics``); these names are not ``vllm:``, so
    the connector does the same for its own, or a second engine started in one process (with
    stats on) fails at start-up with prometheus_client's DuplicateTimeseries."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._unregister_previous()
        tokens = self._counter_cls(name="prefixstore_vllm_lookup_tokens_total",
                                   documentation="Prompt tokens looked up in prefixstore, by kind and result.",
                                   labelnames=[*labelnames, "kind", "result"])
        self._tokens: dict[tuple[int, str, str], Any] = {
            (idx, kind, result): tokens.labels(*values, kind, result)
            for idx, values in per_engine_labelvalues.items() for kind in ("kv", "state") for result in ("hit", "miss")}
        events = self._counter_cls(name="prefixstore_vllm_events_total",
                                   documentation="Connector events: " + ", ".join(EVENT_KEYS) + ".",
                                   labelnames=[*labelnames, "event"])
        self._events_keys = EVENT_KEYS
        self._events: dict[tuple[int, str], Any] = {
            (idx, key): events.labels(*values, key)
            for idx, values in per_engine_labelvalues.items() for key in self._events_keys}
        loaded = self._counter_cls(name="prefixstore_vllm_loaded_tokens_total",
                                   documentation="Prompt tokens loads wrote into vLLM's blocks (KV, and the state "
                                                 "after them on a hybrid model), so not computed.",
                                   labelnames=labelnames)
        self._loaded: dict[int, Any] = {idx: loaded.labels(*values) for idx, values in per_engine_labelvalues.items()}
        waited = self._counter_cls(name="prefixstore_vllm_commit_wait_seconds_total",
                                   documentation="Seconds a decode instance's loads waited for the prefill instance's "
                                                 "save to be committed (prefill/decode disaggregation).",
                                   labelnames=labelnames)
        self._waited: dict[int, Any] = {idx: waited.labels(*values) for idx, values in per_engine_labelvalues.items()}
        moved = self._counter_cls(name="prefixstore_vllm_transfer_bytes_total",
                                  documentation="Payload bytes moved between vLLM and prefixstore.",
                                  labelnames=[*labelnames, "direction"])
        self._bytes: dict[tuple[int, str], Any] = {
            (idx, d): moved.labels(*values, d)
            for idx, values in per_engine_labelvalues.items() for d in ("load", "save")}
        steps = self._counter_cls(name="prefixstore_vllm_decode_steps_total",
                                  documentation="Decode-only engine steps (every request computes one token), by "
                                                "whether a load of the connector was in flight and by batch size.",
                                  labelnames=[*labelnames, "load_in_flight", "batch"])
        step_s = self._counter_cls(name="prefixstore_vllm_decode_step_seconds_total",
                                   documentation="Forward-pass seconds of those steps (start_load_kv to the end of "
                                                 "wait_for_save, on the worker).",
                                   labelnames=[*labelnames, "load_in_flight", "batch"])
        self._steps: dict[tuple[int, str], tuple[Any, Any]] = {
            (idx, f"{flag}:{name}"): (steps.labels(*values, flag, name), step_s.labels(*values, flag, name))
            for idx, values in per_engine_labelvalues.items() for flag in ("yes", "no") for _, _, name in BATCH_BUCKETS}
        costs = self._gauge_cls(name="prefixstore_vllm_cost_seconds",
                                documentation="The figures the connector's last load decision used (docs/vllm.md, "
                                              "load_policy): prefill_per_token, load_per_token and wait_per_token "
                                              "(seconds per token), decode_step, load_fixed and wait_fixed (seconds; "
                                              "wait_*: the wait the scheduler measured, which the decision uses "
                                              "where there is one).",
                                labelnames=[*labelnames, "figure"])
        self._costs: dict[tuple[int, str], Any] = {
            (idx, key): costs.labels(*values, figure)
            for idx, values in per_engine_labelvalues.items() for key, figure in COST_KEYS.items()}
        PrefixStorePromMetrics._collectors = [tokens, events, loaded, waited, moved, steps, step_s, costs]

    @classmethod
    def _unregister_previous(cls) -> None:
        from prometheus_client import REGISTRY

        for collector in cls._collectors:
            try:
                REGISTRY.unregister(collector)
            except KeyError:  # not in the default registry (vLLM's multiprocess mode, a test's classes)
                pass
        cls._collectors = []

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        q = d.get("query_tokens", 0)
        for kind, hits in (("kv", d.get("kv_hit_tokens", 0)), ("state", d.get("state_hit_tokens", 0))):
            self._tokens[(engine_idx, kind, "hit")].inc(hits)
            self._tokens[(engine_idx, kind, "miss")].inc(max(q - hits, 0))
        for key in self._events_keys:
            self._events[(engine_idx, key)].inc(d.get(key, 0))
        self._loaded[engine_idx].inc(d.get("loaded_tokens", 0))
        self._waited[engine_idx].inc(d.get("commit_wait_ms", 0) / 1e3)
        self._bytes[(engine_idx, "load")].inc(d.get("loaded_bytes", 0))
        self._bytes[(engine_idx, "save")].inc(d.get("saved_bytes", 0))
        for key, value in d.items():
            if key in COST_KEYS:
                self._costs[(engine_idx, key)].set(value / 1e6)
            elif key.startswith("decode_steps:"):
                which = key.split(":", 1)[1]
                count, seconds = self._steps[(engine_idx, which)]
                count.inc(value)
                seconds.inc(d.get(f"decode_step_us:{which}", 0) / 1e6)


class StatsBox:
    """The counters one role object adds to, thread-safe (the worker counts on its client loop),
    handed to vLLM and reset by ``take``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = PrefixStoreStats()

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._stats.add(key, n)

    def set(self, key: str, value: int) -> None:
        with self._lock:
            self._stats.set(key, value)

    def take(self) -> PrefixStoreStats | None:
        with self._lock:
            if self._stats.is_empty():
                return None
            out, self._stats = self._stats, PrefixStoreStats()
            return out


class RateLimitedLog:
    """Warnings of one kind (one format string) at most once per ``interval_s``, each saying how
    many were left out since the last: a refusing worker or a dead store answers every request
    the same way, and must not flood the engine's log."""

    def __init__(self, logger: logging.Logger, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger, self._interval_s, self._clock = logger, interval_s, clock
        self._lock = threading.Lock()
        self._next: dict[str, float] = {}
        self._quiet: dict[str, int] = {}

    def warning(self, msg: str, *args: object) -> None:
        now = self._clock()
        with self._lock:  # the engine thread and the client loop both warn
            if now < self._next.get(msg, -1.0):
                self._quiet[msg] = self._quiet.get(msg, 0) + 1
                return
            self._next[msg] = now + self._interval_s
            quiet = self._quiet.pop(msg, 0)
        suffix = f" ({quiet} more like it since the last such line, not logged)" if quiet else ""
        self._logger.warning(msg + "%s", *args, suffix, stacklevel=2)


__all__ = ["BATCH_BUCKETS", "COST_KEYS", "EVENT_KEYS", "STAT_KEYS", "PrefixStorePromMetrics", "PrefixStoreStats", "RateLimitedLog", "StatsBox", "decode_step_keys"]
