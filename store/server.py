"""The HTTP plane: aiohttp handlers mapping framed requests onto :class:`Store`.

Endpoints (all POST bodies are frames, see protocol/wire.py)::

    POST /v1/namespaces   {namespace}                 -> {ns}
    POST /v1/lookup       {ns, hashes, tokens, ...}   -> LookupAnswer
    POST /v1/offer        {ns, items}                 -> {results: [[want|have|rejected, reason]]}
    POST /v1/put          {ns, items, commit} + payloads -> {results: [[status, reason]]}
    POST /v1/commit       {ns, keys}                  -> {results}
    POST /v1/get          {ns, items}                 -> {items: [[status, size, checksum]]} + payloads
    POST /v1/release      {lease}                     -> {released}
    GET  /v1/members  POST /v1/probe  /v1/lookup_report  /v1/replica/drop   (cluster: store/cluster.py)
    POST /v1/nixl/metadata {}                         -> {agent, metadata, region}  (store/nixl_target.py)
    POST /v1/nixl/get     {ns, items}                 -> {agent, items: [[status, size, checksum, descs]], lease}
    POST /v1/nixl/reserve {ns, items}                 -> {agent, results: [[status, reason, descs]], ttl_s}
    POST /v1/nixl/commit  {ns, keys, commit}          -> {results}
    GET  /v1/stats                                    (admin token when tenants are configured)
    POST /v1/admin/flush                              -> {flushed}   (admin token when tenants are configured)
    GET  /healthz  /metrics                           (always open: no cache contents or keys; /metrics
                                                       names tenants in its quota label: scrape it over a
                                                       trusted network)

Tenants (``tenants_file``, see store/tenants.py): every /v1/* request then
carries ``Authorization: Bearer TOKEN``; a missing or unknown token is 401
naming ``authorization``. A tenant registers only namespaces whose tenant
field is its name (403 naming ``ns`` otherwise) and every other request on a
namespace of another tenant is answered exactly like an unknown namespace
(404), so a tenant cannot learn that another tenant's namespace exists.

A request body that is not in within ``request_timeout_s`` is answered 408
(a put's reserved pages are freed), and a get answer the client does not take
within it is cut off (its pins dropped): a stalled client holds nothing.

Browsers: every POST must carry the frame content type
(``application/x-prefixstore-frame``, else 415 naming ``content-type``) and no
``Origin`` header (403 naming ``origin``). A web page can make a browser send
neither without a CORS preflight, which this server never grants, so a page
cannot drive an open store (no tenants file) from a user's browser.

Malformed input is answered 4xx with a JSON body ``{"error", "field"}``; an
unexpected exception is logged and answered 500, and the server keeps
serving. Put bodies are streamed straight into reserved arena pages and get
bodies are streamed out of them, so bulk bytes are never copied into
intermediate Python objects on the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from ..protocol.namespace import Namespace, NamespaceError
from ..protocol.stream import FrameReader
from ..protocol.wire import (
    CONTENT_TYPE,
    PREFIX_BYTES,
    REASON_QUOTA,
    STATUS_OK,
    GetResult,
    LookupAnswer,
    LookupRequest,
    WireError,
    decode_frame,
    encode_frame,
    encode_header,
    parse_get_items,
    parse_items,
    req_bin,
    req_bool,
    req_entry_keys,
)
from .config import StoreConfig
from .core import OPEN_TENANT, Store  # OPEN_TENANT: the tenant of every request without a tenants file
from .membership import DnsResolver
from .tenants import Tenant

NAMESPACE_BODY_BYTES = 16 << 10
"""Most bytes a namespace registration may carry: a record within protocol/namespace.py's bounds
is under 2 KiB, and the body is refused on its Content-Length before any of it is parsed."""

log = logging.getLogger(__name__)

STORE = web.AppKey("store", Store)
LookupExtension = Callable[[LookupRequest, LookupAnswer], dict[str, object] | None]
LOOKUP_NIXL: web.AppKey[LookupExtension] = web.AppKey("lookup_nixl")
"""Set by store/nixl_target.py where NIXL is served: the ``nixl`` part of a lookup that asks for it."""
# The cluster token (tenants file: cluster_token_sha256) authenticates another node pushing replicas:
# it reaches every tenant's namespaces, but only on these paths (no lookups, no reads).
PEER = "\x00peer"  # never a tenant name: namespaces' tenant fields are printable
PEER_PATHS = frozenset({"/v1/namespaces", "/v1/put", "/v1/replica/drop"})
TENANT = web.RequestKey("tenant", str)  # the authenticated tenant (OPEN_TENANT on an open store)

ADMIN_PATHS = ("/v1/stats", "/v1/admin/")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _error(status: int, field: str, message: str) -> web.Response:
    return web.json_response({"error": f"{field}: {message}", "field": field}, status=status)


@web.middleware
async def _errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    store = request.app[STORE]
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    started = time.perf_counter()
    try:
        response = await handler(request)
    except WireError as err:
        response = _error(err.status, err.field, err.message)
    except NamespaceError as err:
        response = _error(400, "namespace", str(err))
    except web.HTTPRequestEntityTooLarge as err:
        response = _error(413, "body", f"larger than max_body_bytes ({err.text})")
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error serving %s", endpoint)
        response = _error(500, "server", "internal error (logged); the store keeps serving")
    store.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
    store.metrics.requests.labels(endpoint, f"{response.status // 100}xx").inc()
    return response


def _stalled(store: Store) -> WireError:
    return WireError("body", f"not received within request_timeout_s={store.config.request_timeout_s:g}", 408)


async def _read_control(request: web.Request, limit: int) -> bytes:
    """Read a whole (small) request body, refusing more than ``limit`` bytes or a stall past request_timeout_s."""
    if request.content_length is not None and request.content_length > limit:
        raise WireError("body", f"{request.content_length} bytes exceeds the limit of {limit} for this endpoint", 413)
    chunks: list[bytes] = []
    total = 0
    store = request.app[STORE]
    try:
        async with asyncio.timeout(store.config.request_timeout_s):
            while True:
                chunk = await request.content.readany()
                if not chunk:
                    break
                total += len(chunk)
                if total > limit:
                    raise WireError("body", f"exceeds the limit of {limit} bytes for this endpoint", 413)
                chunks.append(chunk)
    except TimeoutError:
        raise _stalled(store) from None
    return b"".join(chunks)


async def _control_header(request: web.Request) -> dict[str, object]:
    store = request.app[STORE]
    limit = store.config.max_header_bytes + PREFIX_BYTES
    body = await _read_control(request, limit)
    header, rest = decode_frame(body, store.config.max_header_bytes)
    if len(rest):
        raise WireError("frame", f"{len(rest)} bytes follow the header of a request that carries no payload")
    return header


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


@web.middleware
async def _browsers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what only a browser sends (see the module docstring): checked before anything else,
    so a cross-origin page cannot reach any endpoint of an open store."""
    if request.method == "POST":
        if "Origin" in request.headers:
            return _error(403, "origin", "requests from web pages are refused (this store has no browser API)")
        if request.content_type != CONTENT_TYPE:
            return _error(415, "content-type", f"must be {CONTENT_TYPE}, got {request.content_type!r}")
    return await handler(request)


@web.middleware
async def _authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Bearer tokens to tenants (inside the error middleware, so refusals are counted)."""
    store = request.app[STORE]
    tenants = store.tenants
    if tenants is None or not request.path.startswith("/v1/"):
        request[TENANT] = OPEN_TENANT
        return await handler(request)
    token = _bearer(request)
    if request.path.startswith(ADMIN_PATHS):
        if token is None or not tenants.is_admin(token):
            store.metrics.auth_failures.inc()
            return _unauthorized("this endpoint needs the admin bearer token")
        request[TENANT] = OPEN_TENANT
        return await handler(request)
    if token is not None and request.path in PEER_PATHS and tenants.is_peer(token):
        request[TENANT] = PEER  # another node pushing replicas: any tenant's namespace, these paths only
        return await handler(request)
    tenant: Tenant | None = tenants.authenticate(token) if token is not None else None
    if tenant is None:
        store.metrics.auth_failures.inc()
        return _unauthorized("missing 'Bearer TOKEN'" if token is None else "unknown bearer token")
    request[TENANT] = tenant.name
    return await handler(request)


def _unauthorized(message: str) -> web.Response:
    response = _error(401, "authorization", message)
    response.headers["WWW-Authenticate"] = 'Bearer realm="prefixstore"'
    return response


def _owned(request: web.Request, ns_id: bytes) -> Namespace:
    """The namespace, if the caller's tenant owns it; another tenant's is answered as unknown (404)."""
    store = request.app[STORE]
    ns = store.namespace(ns_id)
    if store.tenants is not None and ns.tenant != request[TENANT] and request[TENANT] != PEER:
        raise WireError("ns", f"unknown namespace {ns_id.hex()}; register it with POST /v1/namespaces", 404)
    return ns


def _frame_response(header: dict[str, object]) -> web.Response:
    return web.Response(body=encode_frame(header), content_type=CONTENT_TYPE)


# ---------------------------------------------------------------- handlers


async def register_namespace(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header, rest = decode_frame(await _read_control(request, NAMESPACE_BODY_BYTES), NAMESPACE_BODY_BYTES)
    if len(rest):
        raise WireError("frame", f"{len(rest)} bytes follow the header of a request that carries no payload")
    if "namespace" not in header:
        raise WireError("namespace", "missing")
    ns = Namespace.from_wire(header["namespace"])
    if store.tenants is not None and ns.tenant != request[TENANT] and request[TENANT] != PEER:
        raise WireError("ns", f"the namespace's tenant {ns.tenant!r} is not the tenant of this token", 403)
    ns_id = await store.register_namespace(ns)
    return _frame_response({"ns": ns_id})


async def lookup(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    req = LookupRequest.from_header(header, store.limits, lambda ns_id: _owned(request, ns_id).block_tokens)
    answer = store.lookup(req)
    if req.nixl and (extension := request.app.get(LOOKUP_NIXL)) is not None:
        answer = dataclasses.replace(answer, nixl=extension(req, answer))
    return _frame_response(answer.to_header())


async def offer(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    _owned(request, ns_id)
    results = store.offer(ns_id, parse_items(header, store.limits))
    return _frame_response({"results": [r.to_wire() for r in results]})


async def put(request: web.Request) -> web.Response:
    store = request.app[STORE]
    if request.content_length is not None and request.content_length > store.config.max_body_bytes:
        raise WireError("body", f"{request.content_length} bytes exceeds max_body_bytes={store.config.max_body_bytes}", 413)
    body = FrameReader(request.content)
    # One deadline for the whole body (header and payloads), but not for the
    # commit: cancelling a commit while its LMDB write is in flight would leave
    # the entries half committed, and the commit does not wait on the client.
    deadline = asyncio.get_running_loop().time() + store.config.request_timeout_s
    try:
        async with asyncio.timeout_at(deadline):
            header, header_len = await body.read_header(store.config.max_header_bytes)
    except asyncio.IncompleteReadError:
        raise WireError("frame", "truncated before the end of the header") from None
    except TimeoutError:
        raise _stalled(store) from None
    ns_id = req_bin(header, "ns", size=8)
    _owned(request, ns_id)
    items = parse_items(header, store.limits)
    commit_now = req_bool(header, "commit", default=True)
    if request[TENANT] == PEER and not (commit_now and req_bool(header, "replica", default=False)):
        raise WireError("replica", "the cluster token may only push committed replicas", 403)
    payload_bytes = sum(it.size for it in items)
    if PREFIX_BYTES + header_len + payload_bytes > store.config.max_body_bytes:
        raise WireError("body", f"the header lists {payload_bytes} payload bytes, more than "
                        f"max_body_bytes={store.config.max_body_bytes} allows", 413)
    declared = request.content_length
    if declared is not None and declared != PREFIX_BYTES + header_len + payload_bytes:
        raise WireError("frame", f"Content-Length is {declared} bytes but the header lists "
                        f"{payload_bytes} payload bytes ({PREFIX_BYTES + header_len + payload_bytes} in all)")
    plan = store.plan_put(ns_id, items)
    over = [i for i, r in enumerate(plan.results) if r.reason == REASON_QUOTA]
    if over:
        # A put over the tenant's quota is refused whole with a 4xx, before any
        # payload byte is read: nothing of it is stored, and the engine is told
        # plainly (offers, which move no bytes, answer per item instead).
        store.abort_put(plan)
        ns = store.namespace(ns_id)
        raise WireError("quota", f"tenant {ns.tenant!r} would exceed its quota of {store.quota_of(ns)} bytes "
                        f"(holds {store.tenant_bytes.get(ns.tenant, 0)}); items {over[:8]} do not fit; "
                        "nothing of this put was stored", 413)
    try:
        async with asyncio.timeout_at(deadline):  # a stalled client must not hold its reserved pages
            for i, target in enumerate(plan.targets):
                if target is None:
                    await body.skip(plan.sizes[i])
                else:
                    await body.readinto(target)
            if not await body.at_eof():
                raise WireError("frame", "bytes follow the last payload the header lists")
    except asyncio.IncompleteReadError:
        store.abort_put(plan)
        raise WireError("frame", "body ended before every payload the header lists arrived") from None
    except TimeoutError:
        store.abort_put(plan)
        raise _stalled(store) from None
    except BaseException:
        store.abort_put(plan)
        raise
    store.metrics.transfer_bytes.labels("in", "http").inc(payload_bytes)
    store.verify_put(plan)
    results = plan.results
    if commit_now:
        keys = [e.wire_key for e in plan.entries if e is not None]
        committed = iter(await store.commit(ns_id, keys))
        results = [next(committed) if e is not None else r for e, r in zip(plan.entries, results)]
        if req_bool(header, "replica", default=False):  # pushed by a hot entry's owner (store/replication.py)
            store.replica_keys.update(e.key for e, r in zip(plan.entries, results)
                                      if e is not None and r.status == STATUS_OK)
    return _frame_response({"results": [r.to_wire() for r in results]})


async def commit(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    _owned(request, ns_id)
    keys = req_entry_keys(header, "keys", store.limits.max_items)
    results = await store.commit(ns_id, keys)
    return _frame_response({"results": [r.to_wire() for r in results]})


async def get(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    header = await _control_header(request)
    ns_id = req_bin(header, "ns", size=8)
    _owned(request, ns_id)
    items = parse_get_items(header, store.limits)
    plan = await store.prepare_get(ns_id, items)
    try:
        results = [GetResult(s.status, s.length, s.checksum) if s.status == STATUS_OK else GetResult(s.status)
                   for s in plan.slots]
        head = encode_header({"items": [r.to_wire() for r in results]})
        payload = plan.payload_bytes
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        response.content_length = len(head) + payload
        await response.prepare(request)
        try:
            # A client that stops reading would otherwise keep these entries
            # pinned (never evicted) for as long as it holds the connection.
            async with asyncio.timeout(store.config.request_timeout_s):
                await response.write(head)
                for slot in plan.slots:
                    if slot.status == STATUS_OK:
                        for view in store.payload_views(slot):
                            await response.write(view)
                await response.write_eof()
        except TimeoutError:
            log.warning("get: client took the answer off the wire slower than request_timeout_s=%g; disconnected",
                        store.config.request_timeout_s)
            if request.transport is not None:
                request.transport.abort()
            raise ConnectionResetError("get answer not read within request_timeout_s") from None
        store.metrics.transfer_bytes.labels("out", "http").inc(payload)
        return response
    finally:
        store.finish_get(plan)


async def release(request: web.Request) -> web.Response:
    store = request.app[STORE]
    header = await _control_header(request)
    lease_id = req_bin(header, "lease", size=16)
    return _frame_response({"released": store.release(lease_id)})


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


def create_app(config: StoreConfig, clock: Callable[[], float] = time.monotonic,
               resolver: DnsResolver | None = None) -> web.Application:
    """The store as an aiohttp application; the store opens in startup and closes in cleanup.

    ``resolver``: the DNS lookups of ``peers_dns`` membership (tests pass their own)."""
    store = Store(config, clock)
    # Put bodies are streamed and bounded by max_body_bytes through Content-Length
    # checks; aiohttp's own limit applies to request.read(), which no handler uses.
    app = web.Application(client_max_size=config.max_body_bytes,
                          middlewares=[_errors_and_metrics, _browsers, _authenticate])
    app[STORE] = store

    async def lifecycle(app: web.Application) -> AsyncIterator[None]:
        await store.start()
        yield
        await store.close()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/namespaces", register_namespace)
    app.router.add_post("/v1/lookup", lookup)
    app.router.add_post("/v1/offer", offer)
    app.router.add_post("/v1/put", put)
    app.router.add_post("/v1/commit", commit)
    app.router.add_post("/v1/get", get)
    app.router.add_post("/v1/release", release)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/stats", stats)
    app.router.add_post("/v1/admin/flush", flush)
    # The NIXL data path (store/nixl_target.py): /v1/nixl/{metadata,get,reserve,commit} and the
    # agent's life cycle. Imported here, not at the top: that module builds on this one's helpers.
    from .nixl_target import install as install_nixl

    install_nixl(app, config)
    # Cluster (store/cluster.py): membership, /v1/members, /v1/probe, hot-prefix replication.
    from .cluster import install as install_cluster

    install_cluster(app, config, clock, resolver)
    return app
