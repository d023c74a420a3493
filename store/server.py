"""``create_app(config)``: the store as an aiohttp application, composed of its route modules.

::

    store/http.py         shared: app keys, middlewares (errors -> status, browsers, tenants), framing
    store/api.py          /v1/namespaces /v1/lookup /v1/offer /v1/put /v1/commit /v1/get /v1/release
    store/admin.py        /healthz /readyz /metrics /v1/stats /v1/admin/{namespaces,config,flush,delete}
    store/cluster.py      /v1/members /v1/probe /v1/lookup_report /v1/replica/drop; membership, replication
    store/nixl_target.py  /v1/nixl/{metadata,get,reserve,commit}; the NIXL agent (docs/nixl.md)
    store/control.py      /v1/control: the control channel (a WebSocket for lookups and probes)

Each route module imports store/http.py and adds its own routes; none imports another, and this
module imports them all, so the plane has no cycles. The store opens in the app's startup and
closes in its cleanup (graceful shutdown: in-flight requests finish, LMDB is closed).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

from aiohttp import web

from . import admin, api, cluster, control, nixl_target
from .config import StoreConfig
from .core import Store
from .http import CONTROL_CALLS, MIDDLEWARES, READINESS, STORE
from .membership import DnsResolver


def create_app(config: StoreConfig, clock: Callable[[], float] = time.monotonic,
               resolver: DnsResolver | None = None) -> web.Application:
    """The store as an aiohttp application.

    ``resolver``: the DNS lookups of ``peers_dns`` membership (tests pass their own)."""
    store = Store(config, clock)
    # Put bodies are streamed and bounded by max_body_bytes through Content-Length
    # checks; aiohttp's own limit applies to request.read(), which no handler uses.
    app = web.Application(client_max_size=config.max_body_bytes, middlewares=MIDDLEWARES)
    app[STORE] = store
    app[READINESS] = {}
    app[CONTROL_CALLS] = {}

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await store.start()
        yield
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    api.install(app)
    admin.install(app)
    nixl_target.install(app, config)
    cluster.install(app, config, clock, resolver)
    control.install(app)
    return app


__all__ = ["STORE", "create_app"]
