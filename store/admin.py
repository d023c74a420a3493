"""Operators' routes: liveness, readiness, metrics, statistics, and the admin commands::

    GET  /healthz                  -> {status}     (open: liveness, cheap, no cache contents)
    GET  /readyz                   -> {ready, checks}  200 ready, 503 not (open: no cache contents)
    GET  /metrics                  Prometheus text (open: no contents or keys; the quota counter's,
                                                   the per-tenant gauge's and the per-model hit
                                                   counter's labels name tenants and their models:
                                                   scrape it over a trusted network)
    GET  /v1/stats                 -> JSON          (admin token when tenants are configured)
    GET  /v1/admin/namespaces      -> {namespaces: [...]}       (admin)
    GET  /v1/admin/config          -> {knobs: {name: {value, source}}}  (admin)
    POST /v1/admin/flush           -> {flushed}     (admin)
    POST /v1/admin/delete {namespace: ID | tenant: NAME} -> {deleted, fork_records, namespaces}  (admin)

The admin token guards everything under /v1/stats and /v1/admin/ (store/http.py). The
``prefixstore`` CLI drives these (prefixstore/admin_cli.py).

Readiness (``/readyz``) is what the chart's readiness and startup probes ask; liveness
(``/healthz``) stays a constant answer so a busy or starting node is never restarted for it. A
node is ready when every check in ``app[READINESS]`` passes: ``lmdb`` (the tier is open and its
index loaded: the port only opens after that, so this is the contract rather than a wait),
``arena`` (the RAM arena is mapped in: its prefault at start-up finished, so the first puts pay
no page faults), and ``membership`` (store/cluster.py: a DNS cluster's node has heard from DNS
once; one that never did does not know which keys are its own).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import time
from collections.abc import AsyncIterator, Mapping

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from prefixstore.protocol import checksums, hashing
from prefixstore.protocol.errors import Problem
from prefixstore.protocol.namespace import MAX_NAME_BYTES, Namespace
from prefixstore.protocol.wire import WireError, req_bin
from .config import StoreConfig
from .core import Store
from .http import CLUSTER_SIZE, READINESS, STORE, control_header

log = logging.getLogger(__name__)

CONFIG_SOURCES: web.AppKey[Mapping[str, str]] = web.AppKey("config_sources")
"""Set by ``prefixstore serve``: where each knob's value came from (StoreConfig.sources)."""
STARTED: web.AppKey[list[float]] = web.AppKey("started")  # [monotonic time the store opened], once open

SCAN_YIELD_EVERY = 50_000  # entries between yields to the event loop while counting per namespace


def version() -> str:
    try:
        return importlib.metadata.version("prefixstore")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def readyz(request: web.Request) -> web.Response:
    checks = {name: check() for name, check in request.app[READINESS].items()}
    ready = all(reason is None for reason in checks.values())
    return web.json_response({"ready": ready, "checks": {k: v or "ok" for k, v in checks.items()}},
                             status=200 if ready else 503)


def _hit_rate(store: Store, kind: str) -> dict[str, object]:
    registry = store.metrics.registry
    hits, misses = (registry.get_sample_value("prefixstore_lookup_tokens_total", {"kind": kind, "result": r}) or 0.0
                    for r in ("hit", "miss"))
    total = hits + misses
    return {"hit_tokens": int(hits), "miss_tokens": int(misses), "rate": hits / total if total else None}


async def stats(request: web.Request) -> web.Response:
    store = request.app[STORE]
    out = store.stats()
    started = request.app[STARTED]
    out["version"] = version()
    out["uptime_s"] = round(time.monotonic() - started[0], 3) if started else 0.0
    out["native"] = {"hash_chain": hashing.NATIVE, "checksums": checksums.NATIVE}
    lookups = store.metrics.registry.get_sample_value("prefixstore_lookups_total") or 0.0
    out["lookups"] = {"answered": int(lookups), "kv": _hit_rate(store, "kv"), "state": _hit_rate(store, "state"),
                      "models": store.metrics.model_hits.describe()}
    out["cluster_size"] = request.app[CLUSTER_SIZE]() if CLUSTER_SIZE in request.app else 1
    return web.json_response(out)


def _describe(ns: Namespace, counts: Mapping[str, int]) -> dict[str, object]:
    return {"id": ns.id.hex(), "tenant": ns.tenant, "model": ns.model, "revision": ns.revision,
            "block_tokens": ns.block_tokens, "hash_scheme": ns.hash_scheme,
            **({"tp": f"{ns.tp_rank}/{ns.tp_size}"} if ns.legacy else {}),
            "kv": {"num_layers": ns.kv.num_layers, "num_heads": ns.kv.num_heads, "head_dim": ns.kv.head_dim,
                   "dtype": ns.kv.dtype, "token_bytes": ns.kv.token_bytes},
            "state": ({"num_layers": ns.state.num_layers, "snapshot_bytes": ns.state.snapshot_bytes}
                      if ns.has_state else None),
            "entries": dict(counts)}


def _no_entries() -> dict[str, int]:
    return {"kv": 0, "state": 0, "bytes": 0, "fork_records": 0}


async def _counts(store: Store) -> dict[bytes, dict[str, int]]:
    """Entries and payload bytes per namespace, in one pass over the index that yields to the event
    loop every SCAN_YIELD_EVERY entries (a million entries must not stall requests)."""
    out: dict[bytes, dict[str, int]] = {}
    for i, e in enumerate(list(store.index.entries.values())):
        if i and i % SCAN_YIELD_EVERY == 0:
            await asyncio.sleep(0)
        if e.dead:
            continue
        c = out.setdefault(e.namespace_id, _no_entries())
        if e.record:  # a cluster's fork record: no payload (store/index.py)
            c["fork_records"] += 1
            continue
        c[e.metric_kind] += 1
        c["bytes"] += e.size
    return out


async def namespaces(request: web.Request) -> web.Response:
    store = request.app[STORE]
    counts = await _counts(store)
    listed = sorted(store.namespaces, key=lambda ns: (ns.tenant, ns.model, ns.id))
    return web.json_response({"namespaces": [_describe(ns, counts.get(ns.id) or _no_entries())
                                             for ns in listed]})


def _json_value(value: object) -> object:
    return value if isinstance(value, (bool, int, float, str)) else str(value)


async def config(request: web.Request) -> web.Response:
    store = request.app[STORE]
    sources = request.app.get(CONFIG_SOURCES, {})
    knobs = {f.name: {"value": _json_value(store.config.effective(f.name)), "source": sources.get(f.name, "unknown")}
             for f in StoreConfig.knobs()}
    return web.json_response({"knobs": knobs})


async def flush(request: web.Request) -> web.Response:
    store = request.app[STORE]
    flushed = store.flush()
    await store.flush_deletes()
    log.warning("admin flush: deleted %d entries", flushed)
    return web.json_response({"flushed": flushed})


def _chosen(store: Store, header: dict[str, object]) -> tuple[str, list[Namespace]]:
    """The namespaces a delete names: exactly one of ``namespace`` (its 8-byte id) and ``tenant``."""
    given = [k for k in ("namespace", "tenant") if k in header]
    if len(given) != 1:
        raise WireError("namespace", "name exactly one of 'namespace' (an 8-byte id) and 'tenant' (a name)")
    if given[0] == "namespace":
        ns_id = req_bin(header, "namespace", size=8)
        ns = store.namespaces.find(ns_id)
        if ns is None:
            raise WireError("namespace", f"unknown namespace {ns_id.hex()}", Problem.UNKNOWN)
        return f"namespace {ns_id.hex()}", [ns]
    tenant = header["tenant"]
    if not isinstance(tenant, str) or not 0 < len(tenant.encode()) <= MAX_NAME_BYTES:
        raise WireError("tenant", f"expected a tenant name of 1 to {MAX_NAME_BYTES} bytes")
    chosen = [ns for ns in store.namespaces if ns.tenant == tenant]
    known = store.tenants.has(tenant) if store.tenants is not None else False
    if not chosen and not known:
        raise WireError("tenant", f"no tenant {tenant!r} (not in the tenants file, and no namespace names it)",
                        Problem.UNKNOWN)
    return f"tenant {tenant!r}", chosen


async def delete(request: web.Request) -> web.Response:
    store = request.app[STORE]
    what, chosen = _chosen(store, await control_header(request, 4096))
    ids = {ns.id for ns in chosen}
    # Fork records go with their namespaces but hold no payload: answered apart, so the count matches
    # the entries `prefixstore stats` and `namespaces` show. (The delete itself is one pass as well.)
    records = sum(1 for e in store.index.entries.values() if e.record and e.namespace_id in ids)
    removed = store.delete_namespaces(ids)
    await store.flush_deletes()
    log.warning("admin delete (%s): deleted %d entries and %d fork records of %d namespaces", what,
                removed - records, records, len(chosen))
    return web.json_response({"deleted": removed - records, "fork_records": records,
                              "namespaces": [ns.id.hex() for ns in chosen]})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STORE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def _lmdb_check(app: web.Application) -> str | None:
    return None if app[STARTED] else "the store is still opening its LMDB tier and loading its index"


def _arena_check(store: Store) -> str | None:
    return None if store.arena_ready else f"the RAM arena ({store.arena.capacity_bytes} bytes) is still being mapped in"


def install(app: web.Application) -> None:
    store = app[STORE]
    app[STARTED] = []
    app[READINESS]["lmdb"] = lambda: _lmdb_check(app)
    app[READINESS]["arena"] = lambda: _arena_check(store)

    async def opened(app: web.Application) -> AsyncIterator[None]:
        app[STARTED].append(time.monotonic())  # after the store's own start-up (store/server.py's order)
        yield

    app.cleanup_ctx.append(opened)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    app.router.add_get("/v1/admin/namespaces", namespaces)
    app.router.add_get("/v1/admin/config", config)
    app.router.add_post("/v1/admin/flush", flush)
    app.router.add_post("/v1/admin/delete", delete)


def sources_of(app: web.Application, sources: Mapping[str, str]) -> None:
    """Record where each knob came from, for /v1/admin/config (before the app starts)."""
    app[CONFIG_SOURCES] = dict(sources)


__all__ = ["CONFIG_SOURCES", "install", "sources_of", "version"]
