"""Operators' routes: liveness, metrics, statistics, flush::

    GET  /healthz                  -> {status}     (open: no cache contents)
    GET  /metrics                  Prometheus text (open: no contents or keys; the quota counter's
                                                   ``tenant`` label names tenants: scrape it over a
                                                   trusted network)
    GET  /v1/stats                 -> JSON          (admin token when tenants are configured)
    POST /v1/admin/flush           -> {flushed}     (admin token when tenants are configured)
"""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .http import STORE

log = logging.getLogger(__name__)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def stats(request: web.Request) -> web.Response:
    return web.json_response(request.app[STORE].stats())


async def flush(request: web.Request) -> web.Response:
    store = request.app[STORE]
    flushed = store.flush()
    await store.flush_deletes()
    log.warning("admin flush: deleted %d entries", flushed)
    return web.json_response({"flushed": flushed})


async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(request.app[STORE].metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def install(app: web.Application) -> None:
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/admin/flush", flush)


__all__ = ["install"]
