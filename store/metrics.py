"""Prometheus metrics. Names are public API: `_total`, `_bytes`, `_seconds`, no colons.

Counters are counted where things happen; stored bytes and entries are read
from the index's own counters at scrape time (a custom collector), so they
can never drift from what the index holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, PlatformCollector, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .index import Index
from .model_metrics import ModelHitRates

KINDS = ("kv", "state")
TIERS = ("ram", "disk")
EVICTION_REASONS = ("demoted", "capacity", "corrupt", "expired")

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class _IndexCollector(Collector):
    def __init__(self, index: Index, gauges: Callable[[], dict[str, float]]) -> None:
        self._index = index
        self._gauges = gauges

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Names only: registering must not read the gauges (the store is still being built)."""
        yield GaugeMetricFamily("prefixstore_stored_bytes", "", labels=["kind", "tier"])
        yield GaugeMetricFamily("prefixstore_entries", "", labels=["kind", "tier"])
        for name in _GAUGE_HELP:
            yield GaugeMetricFamily(name, "")

    def collect(self) -> Iterator[GaugeMetricFamily]:
        b = GaugeMetricFamily("prefixstore_stored_bytes", "Payload bytes held, by kind and tier.", labels=["kind", "tier"])
        n = GaugeMetricFamily("prefixstore_entries", "Entries held, by kind and tier.", labels=["kind", "tier"])
        for kind in KINDS:
            for tier in TIERS:
                b.add_metric([kind, tier], self._index.stored_bytes.get((kind, tier), 0))
                n.add_metric([kind, tier], self._index.stored_entries.get((kind, tier), 0))
        yield b
        yield n
        for name, value in self._gauges().items():
            yield GaugeMetricFamily(name, _GAUGE_HELP[name], value=value)


_GAUGE_HELP = {
    "prefixstore_arena_capacity_bytes": "Size of the RAM arena (the hard RAM budget).",
    "prefixstore_arena_free_bytes": "Free bytes in the RAM arena.",
    "prefixstore_leases": "Leases currently held.",
    "prefixstore_pending_entries": "Entries put but not yet committed.",
    "prefixstore_lmdb_read_txns": "LMDB read transactions held open for NIXL READs out of LMDB's map.",
    "prefixstore_write_behind_bytes": "Bytes (payloads and records) of committed entries not yet written to LMDB "
                                      "(durability=write-behind).",
    "prefixstore_write_behind_entries": "Committed entries not yet written to LMDB (durability=write-behind).",
    "prefixstore_write_behind_lag_seconds": "Seconds since the oldest committed entry not yet in LMDB was "
                                            "committed (0: none behind).",
    "prefixstore_read_buffer_bytes": "Bytes gets in flight hold outside the RAM arena (disk-only entries read "
                                     "while every arena page is pinned; at most read_buffer_bytes).",
    "prefixstore_lmdb_full": "1 while the LMDB tier's disk is full (its last write found no space; writes are "
                             "refused and tried again each second), else 0.",
}


TenantUsage = Callable[[], Iterable[tuple[str, int, "int | None"]]]
"""(tenant, bytes held, quota_bytes or None) per tenant, read at scrape time."""


class _TenantCollector(Collector):
    def __init__(self, usage: Callable[[], TenantUsage], leased: Callable[[], Callable[[], Mapping[str, int]]]) -> None:
        self._usage = usage
        self._leased = leased

    def describe(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily("prefixstore_tenant_stored_bytes", "", labels=["tenant"])
        yield GaugeMetricFamily("prefixstore_tenant_quota_bytes", "", labels=["tenant"])
        yield GaugeMetricFamily("prefixstore_tenant_leased_bytes", "", labels=["tenant"])

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = GaugeMetricFamily("prefixstore_tenant_stored_bytes", "Bytes charged to each tenant on this node "
                                 "(entries, pending puts, namespace records); what its quota_bytes bounds.",
                                 labels=["tenant"])
        quota = GaugeMetricFamily("prefixstore_tenant_quota_bytes", "Each tenant's quota_bytes on this node (a "
                                  "quota holds per node), for tenants that have one.", labels=["tenant"])
        for tenant, num_bytes, quota_bytes in self._usage()():
            held.add_metric([tenant], num_bytes)
            if quota_bytes is not None:
                quota.add_metric([tenant], quota_bytes)
        yield held
        yield quota
        leased = GaugeMetricFamily("prefixstore_tenant_leased_bytes", "Payload bytes each tenant's leases pin "
                                   "now (bounded by max_leased_share of the arena).", labels=["tenant"])
        for tenant, num_bytes in sorted(self._leased()().items()):
            leased.add_metric([tenant], num_bytes)
        yield leased


class StoreMetrics:
    def __init__(self, index: Index, gauges: Callable[[], dict[str, float]], model_metrics_per_tenant: int = 16) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.lookup_tokens = Counter(
            "prefixstore_lookup_tokens", "Prompt tokens looked up, by memory kind and result.",
            ["kind", "result"], registry=r)
        # The same per model (store/model_metrics.py: a bounded label per tenant).
        self.model_hits = ModelHitRates(r, model_metrics_per_tenant)
        self.lookups = Counter("prefixstore_lookups", "Lookups answered.", registry=r)
        self.prefill_flops_saved = Counter(
            "prefixstore_prefill_flops_saved", "Prefill FLOPs of the prompt tokens lookups found exactly reusable "
            "(KV and state on hybrid models, KV on plain ones), by the FLOP model of each namespace's model shape "
            "(admission/model_shape.py). What the store offered; an engine that does not load it saves less.",
            registry=r)
        self.admission = Counter(
            "prefixstore_admission", "Offer and put decisions, by kind (kv, state) and decision.",
            ["kind", "decision"], registry=r)
        self.evictions = Counter(
            "prefixstore_evictions", "Entries leaving a tier, by kind and reason "
            "(demoted: dropped from RAM, still on disk; capacity: deleted; corrupt; expired: uncommitted put).",
            ["kind", "reason"], registry=r)
        self.lmdb_resets = Counter(
            "prefixstore_lmdb_resets", "Times the LMDB tier was found damaged (or of another format) and set "
            "aside, the node going on with an empty tier.", registry=r)
        self.lmdb_full_writes = Counter(
            "prefixstore_lmdb_full_writes", "LMDB write transactions that found the disk full (nothing of them "
            "written, nothing committed before lost; tried again a second later).", registry=r)
        self.lmdb_full_refusals = Counter(
            "prefixstore_lmdb_full_refusals", "Entries whose commit was refused because the LMDB tier's disk is "
            "full (durability=sync: at once; write-behind: once its bounds are behind).", registry=r)
        self.read_buffer_refusals = Counter(
            "prefixstore_read_buffer_refusals", "Get items of disk-only entries answered as misses because no arena "
            "page could be freed for them and read_buffer_bytes were held by gets in flight.", registry=r)
        self.lookup_reports_dropped = Counter(
            "prefixstore_lookup_reports_dropped", "Cluster lookup reports that taught nothing because their tenant's "
            "reports were past its allowance (max_lookup_tokens a second plus what its probes here carried).",
            registry=r)
        self.malformed_requests = Counter(
            "prefixstore_malformed_requests", "HTTP requests aiohttp could not parse (answered 400 by it).",
            registry=r)
        self.write_behind_written = Counter(
            "prefixstore_write_behind_written", "Committed entries the write-behind wrote to LMDB.", registry=r)
        self.write_behind_txns = Counter(
            "prefixstore_write_behind_txns", "LMDB transactions of the write-behind (entries per transaction = "
            "written / txns).", registry=r)
        self.write_behind_waits = Counter(
            "prefixstore_write_behind_waits", "Commits that waited for the write-behind to come back within "
            "write_behind_bytes / write_behind_s (back-pressure).", registry=r)
        self.checksum_failures = Counter(
            "prefixstore_checksum_failures", "Payloads whose checksum did not verify, by where they were read.",
            ["tier"], registry=r)
        self.transfer_bytes = Counter(
            "prefixstore_transfer_bytes", "Payload bytes moved, by direction (in, out) and path (http, nixl). NIXL "
            "transfers are one-sided (the store does not see them): out counts the bytes handed out under a lease "
            "for the client to READ (lookup and probe placements, /v1/nixl/get), in the bytes verified at commit.",
            ["direction", "path"], registry=r)
        self.requests = Counter(
            "prefixstore_requests", "HTTP requests, by endpoint and status class.", ["endpoint", "status"], registry=r)
        self.quota_rejections = Counter(
            "prefixstore_quota_rejections", "Offer and put items refused because their tenant is at quota_bytes.",
            ["tenant"], registry=r)
        self.auth_failures = Counter(
            "prefixstore_auth_failures", "Requests refused for a missing or unknown bearer token (401).", registry=r)
        self.latency = Histogram(
            "prefixstore_request_duration_seconds", "Server-side request latency by endpoint.",
            ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self._per_request: dict[tuple[str, int], tuple[Any, Any]] = {}  # observe_request's labelled children
        # Connection limits (max_connections, header_timeout_s).
        self.connections = Gauge("prefixstore_connections", "Client connections open now.", registry=r)
        self.control_channels = Gauge(
            "prefixstore_control_channels",
            "Control channels open now (GET /v1/control WebSockets carrying lookups and probes; each holds "
            "one of the connections).", registry=r)
        self.connections_refused = Counter(
            "prefixstore_connections_refused", "Connections closed on arrival because max_connections were open.",
            registry=r)
        self.max_connections = Gauge(
            "prefixstore_max_connections", "The connection cap in force: max_connections, or lower when the "
            "descriptor limit (RLIMIT_NOFILE) leaves room for fewer (store/runner.py).", registry=r)
        self.accept_errors = Counter(
            "prefixstore_accept_errors", "Connections the kernel could not hand over for want of descriptors "
            "(accept() failing with EMFILE/ENFILE; retried a second later).", registry=r)
        # Data paths: 1 for each path this node serves (http always; nixl when its agent is up).
        self.data_path = Gauge("prefixstore_data_path", "Data paths this node serves (1: served).", ["path"], registry=r)
        self.nixl_disk_reads = Counter(
            "prefixstore_nixl_disk_reads", "LMDB-resident payloads asked for over NIXL, by how they were offered "
            "(map: READ straight from LMDB's memory map; promoted: copied into the RAM arena first).",
            ["how"], registry=r)
        self.nixl_map_revoked = Counter(
            "prefixstore_nixl_map_revoked", "NIXL leases ended early because LMDB's map grew (moved) under them.",
            registry=r)
        for how in ("map", "promoted"):
            self.nixl_disk_reads.labels(how)
        # Labelled counters exist from start at 0, so rate() and the alerts see a series, not nothing.
        for tier in ("disk", "network"):  # where payloads are verified (store/reads.py, store/writes.py)
            self.checksum_failures.labels(tier)
        for kind in KINDS:
            for reason in EVICTION_REASONS:
                self.evictions.labels(kind, reason)
        # Cluster: membership and hot-prefix replication.
        self.members = Gauge("prefixstore_members", "Cluster members this node currently sees (itself included).",
                             registry=r)
        self.replicas = Gauge(
            "prefixstore_replicas", "Entries this node holds as replicas of another node's keys, by kind.",
            ["kind"], registry=r)
        self.replication_pushes = Counter(
            "prefixstore_replication_pushes", "Entries pushed to replica nodes, by result (ok, failed, skipped).",
            ["result"], registry=r)
        self.replication_bytes = Counter(
            "prefixstore_replication_bytes", "Payload bytes pushed to replica nodes.", registry=r)
        self.data_path.labels("http").set(1)
        self.data_path.labels("nixl").set(0)
        self.members.set(1)
        for kind in KINDS:
            self.replicas.labels(kind).set(0)
        for direction in ("in", "out"):
            for path in ("http", "nixl"):
                self.transfer_bytes.labels(direction, path)
        for result in ("ok", "failed", "skipped"):
            self.replication_pushes.labels(result)
        for kind in KINDS:
            for result in ("hit", "miss"):
                self.lookup_tokens.labels(kind, result)
        r.register(_IndexCollector(index, gauges))
        self.tenant_usage: TenantUsage = lambda: ()  # set by the Store once its ledger exists
        self.tenant_leased: Callable[[], Mapping[str, int]] = dict  # ... and once its leases exist
        r.register(_TenantCollector(lambda: self.tenant_usage, lambda: self.tenant_leased))
        # The process itself (process_resident_memory_bytes, process_open_fds, CPU seconds, start time;
        # read from /proc, so Linux only: elsewhere they are absent) and python_info. The arena is
        # resident from start, so RSS minus prefixstore_arena_capacity_bytes is the node's overhead.
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        """One answered request: its latency and its count by status class. The labelled children
        are looked up once per (endpoint, status class), not per request (prometheus_client's
        ``labels`` takes a lock and builds a key each time; endpoints are the app's routes)."""
        key = (endpoint, status // 100)
        children = self._per_request.get(key)
        if children is None:
            children = (self.latency.labels(endpoint), self.requests.labels(endpoint, f"{status // 100}xx"))
            self._per_request[key] = children
        children[0].observe(seconds)
        children[1].inc()
