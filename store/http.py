"""The HTTP plane's shared parts: app keys, middlewares, control-frame parsing, framing and
namespace ownership. Every route module (store/api.py, admin.py, cluster.py, nixl_target.py)
imports this one and contributes its own routes; store/server.py composes them. Nothing here
imports a route module, so the plane has no cycles.

Refusals: a handler (or the store under it) raises :class:`protocol.errors.RequestError`
(``WireError`` is one) naming the field; :func:`errors_and_metrics` answers it with
``HTTP_STATUS[problem]`` and a JSON body ``{"error", "field"}``. An unexpected exception is
logged and answered 500, and the server keeps serving. Nothing else in the store knows HTTP
status codes.

Tenants (``tenants_file``, store/tenants.py): every /v1/* request carries
``Authorization: Bearer TOKEN``; a missing or unknown token is 401 naming ``authorization``. A
tenant reaches only namespaces whose tenant field is its name (:func:`owned`); another tenant's
namespace is answered exactly like an unknown one (404), so a tenant cannot learn it exists.

Browsers: every POST must carry the frame content type (else 415 naming ``content-type``) and no
``Origin`` header (403 naming ``origin``). A web page can make a browser send neither without a
CORS preflight, which this server never grants, so a page cannot drive an open store.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from prefixstore.protocol.errors import HTTP_STATUS, Problem, RequestError
from prefixstore.protocol.namespace import Namespace, NamespaceError
from prefixstore.protocol.nixl_wire import NixlPlacements
from prefixstore.protocol.probe import ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import (CONTENT_TYPE, PREFIX_BYTES, ItemSpec, LookupAnswer, LookupRequest, WireError, decode_frame,
                                       encode_frame)
from .core import Store
from .ledger import OPEN_TENANT
from .namespaces import unknown

log = logging.getLogger(__name__)

STORE = web.AppKey("store", Store)
TENANT = web.RequestKey("tenant", str)  # the authenticated tenant (OPEN_TENANT on an open store)
ADMIN = web.RequestKey("admin", bool)  # set (True) where the admin token was presented
BODY_SENT = web.RequestKey("body_sent", int)
"""Answer bytes a handler sent past the response (store/sendbody.py): counted in the access log."""

LookupExtension = Callable[[LookupRequest, LookupAnswer], "NixlPlacements | None"]
LOOKUP_NIXL: web.AppKey[LookupExtension] = web.AppKey("lookup_nixl")
"""Set by store/nixl_target.py where NIXL is served: the ``nixl`` part of a lookup that asks for it."""
ProbeExtension = Callable[[ProbeRequest, ProbeAnswer], "NixlPlacements | None"]
PROBE_NIXL: web.AppKey[ProbeExtension] = web.AppKey("probe_nixl")
"""The same for a cluster probe."""
CLUSTER_SIZE: web.AppKey[Callable[[], int]] = web.AppKey("cluster_size")
"""Set by store/cluster.py: how many members this node's cluster has now (1: a single node)."""
ReadinessCheck = Callable[[], "str | None"]
READINESS: web.AppKey[dict[str, ReadinessCheck]] = web.AppKey("readiness")
"""Made by create_app; route modules add their checks (None: passes; else why not): /readyz (store/admin.py)."""
Answerer = Callable[[web.Request, dict[str, object]], dict[str, object]]
CONTROL_CALLS: web.AppKey[dict[str, Answerer]] = web.AppKey("control_calls")
"""Made by create_app; route modules add the calls that are answered from a request header alone,
at once (no payload, no wait): the POST route and the control channel (store/control.py) both
answer through them. Each takes the request that authenticated the caller (its ``TENANT``)."""


def single_node_only(request: web.Request, what: str) -> None:
    """Refuse, with 409 naming the fix, a call that only a single node can answer (a lookup over
    this node's index alone) when this node is one of several: its index holds only its branches
    (protocol/placement.py), so the answer would be silently partial."""
    size = request.app[CLUSTER_SIZE]() if CLUSTER_SIZE in request.app else 1
    if size > 1:
        raise WireError(what, f"this node is one of the {size} members of a cluster and holds only its "
                        "branches: connect through the cluster (ClientConfig(urls=(...)) with the members "
                        "or the headless Service, docs/cluster.md); cluster clients use /v1/probe",
                        Problem.CONFLICT)


def placed(request: web.Request, items: Sequence[ItemSpec]) -> None:
    """On a node of a larger cluster every item of an offer, put or NIXL reserve names its branch
    (protocol/placement.py): an item without one comes from a single-node client, whose saves would
    land where no lookup finds them."""
    for i, item in enumerate(items):
        if item.branch is None:
            single_node_only(request, f"items[{i}].branch")

# The cluster token (tenants file: cluster_token_sha256) authenticates another node pushing replicas:
# it reaches every tenant's namespaces, but only on these paths (no lookups, no reads).
PEER = "\x00peer"  # never a tenant name: namespaces' tenant fields are printable
PEER_PATHS = frozenset({"/v1/namespaces", "/v1/put", "/v1/replica/drop"})
ADMIN_PATHS = ("/v1/stats", "/v1/admin/")  # the admin token's (store/admin.py)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_body(field: str, message: str) -> bytes:
    """A refusal's body: JSON naming the field."""
    return json.dumps({"error": f"{field}: {message}", "field": field}).encode()


def error_response(status: int, field: str, message: str) -> web.Response:
    return web.json_response({"error": f"{field}: {message}", "field": field}, status=status)


def refusal_of(err: BaseException) -> tuple[int, str, str] | None:
    """A refusal's (status, field, message), for the errors a handler raises on bad input; None
    for any other exception (a 500)."""
    if isinstance(err, RequestError):
        return HTTP_STATUS[err.problem], err.field, err.message
    if isinstance(err, NamespaceError):
        return 400, "namespace", str(err)
    return None


@web.middleware
async def errors_and_metrics(request: web.Request, handler: Handler) -> web.StreamResponse:
    store = request.app[STORE]
    endpoint = request.match_info.route.resource.canonical if request.match_info.route.resource else "unknown"
    started = time.perf_counter()
    try:
        response = await handler(request)
        if isinstance(response, web.WebSocketResponse) and response.prepared:
            return response  # the control channel's life is not a request: its calls are counted each
    except (RequestError, NamespaceError) as err:
        refused = refusal_of(err)
        assert refused is not None
        response = error_response(*refused)
    except web.HTTPRequestEntityTooLarge as err:
        response = error_response(413, "body", f"larger than max_body_bytes ({err.text})")
    except web.HTTPException:
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        log.exception("unexpected error serving %s", endpoint)
        response = error_response(500, "server", "internal error (logged); the store keeps serving")
    elapsed_s = time.perf_counter() - started
    store.metrics.observe_request(endpoint, response.status, elapsed_s)
    config = store.config
    slow = 0 < config.slow_request_s < elapsed_s
    if config.access_log or slow:
        log_access(request, response, endpoint, elapsed_s, slow)
    return response


access_log = logging.getLogger("prefixstore.access")


def log_access(request: web.Request, response: web.StreamResponse, endpoint: str, elapsed_s: float,
               slow: bool) -> None:
    """One access line (store config ``access_log``, ``slow_request_s``). What it names is chosen, not
    dumped: the route (never the path's query string, which may carry a key), the tenant's name (never
    its token), sizes (never payloads)."""
    tenant = "(admin)" if request.get(ADMIN) else request.get(TENANT)
    sent = response.body_length + request.get(BODY_SENT, 0) if response.prepared else 0
    fields = {"method": request.method, "endpoint": endpoint,
              "tenant": "(peer)" if tenant == PEER else tenant or "-", "status": response.status,
              "bytes_in": request.content_length or 0, "bytes_out": sent or response.content_length or 0,
              "ms": round(elapsed_s * 1000, 3), "peer": request.remote or "-"}
    access_log.log(logging.WARNING if slow else logging.INFO,
                   "%s%s %s tenant=%s status=%d in=%dB out=%dB %.3fms peer=%s", "slow request: " if slow else "",
                   fields["method"], endpoint, fields["tenant"], fields["status"], fields["bytes_in"],
                   fields["bytes_out"], fields["ms"], fields["peer"], extra={"access": fields})


@web.middleware
async def browsers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Refuse what only a browser sends (module docstring): before anything else."""
    if request.method == "POST":
        if "Origin" in request.headers:
            return error_response(403, "origin", "requests from web pages are refused (this store has no browser API)")
        if request.content_type != CONTENT_TYPE:
            return error_response(415, "content-type", f"must be {CONTENT_TYPE}, got {request.content_type!r}")
    return await handler(request)


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _unauthorized(message: str) -> web.Response:
    response = error_response(401, "authorization", message)
    response.headers["WWW-Authenticate"] = 'Bearer realm="prefixstore"'
    return response


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
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
        request[ADMIN] = True
        return await handler(request)
    if token is not None and request.path == "/v1/members" and tenants.is_admin(token):
        request[TENANT] = OPEN_TENANT  # the admin CLI's --cluster asks any node for the members
        request[ADMIN] = True
        return await handler(request)
    if token is not None and request.path in PEER_PATHS and tenants.is_peer(token):
        request[TENANT] = PEER  # another node pushing replicas: any tenant's namespace, these paths only
        return await handler(request)
    tenant = tenants.authenticate(token) if token is not None else None
    if tenant is None:
        store.metrics.auth_failures.inc()
        return _unauthorized("missing 'Bearer TOKEN'" if token is None else "unknown bearer token")
    request[TENANT] = tenant.name
    return await handler(request)


MIDDLEWARES = (errors_and_metrics, browsers, authenticate)


def stalled(store: Store) -> WireError:
    return WireError("body", f"not received within request_timeout_s={store.config.request_timeout_s:g}",
                     Problem.TIMEOUT)


async def read_body(request: web.Request, limit: int) -> bytes:
    """Read a whole (small) request body, refusing more than ``limit`` bytes or a stall past request_timeout_s."""
    if request.content_length is not None and request.content_length > limit:
        raise WireError("body", f"{request.content_length} bytes exceeds the limit of {limit} for this endpoint",
                        Problem.TOO_LARGE)
    content = request.content
    if content.is_eof():
        # The whole body has arrived (a control call's small frame comes with its head): take it
        # as it is, with no wait to bound, so no timer and no read loop.
        body = content.read_nowait()
        if len(body) > limit:
            raise WireError("body", f"exceeds the limit of {limit} bytes for this endpoint", Problem.TOO_LARGE)
        return body
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
                    raise WireError("body", f"exceeds the limit of {limit} bytes for this endpoint", Problem.TOO_LARGE)
                chunks.append(chunk)
    except TimeoutError:
        raise stalled(store) from None
    return b"".join(chunks)


async def control_header(request: web.Request, limit: int | None = None) -> dict[str, object]:
    """The header of a request frame that carries no payload (at most ``limit`` header bytes;
    default ``max_header_bytes``)."""
    store = request.app[STORE]
    max_header = store.config.max_header_bytes if limit is None else limit
    header, rest = decode_frame(await read_body(request, max_header + PREFIX_BYTES), max_header)
    if len(rest):
        raise WireError("frame", f"{len(rest)} bytes follow the header of a request that carries no payload")
    return header


def owned(request: web.Request, ns_id: bytes) -> Namespace:
    """The namespace, if the caller's tenant owns it; another tenant's is answered as unknown (404)."""
    store = request.app[STORE]
    ns = store.namespace(ns_id)
    if store.tenants is not None and ns.tenant != request[TENANT] and request[TENANT] != PEER:
        raise unknown(ns_id)
    return ns


def frame_response(header: dict[str, object]) -> web.Response:
    return web.Response(body=encode_frame(header), content_type=CONTENT_TYPE)


__all__ = ["ADMIN_PATHS", "Answerer", "access_log", "BODY_SENT", "CONTROL_CALLS", "LOOKUP_NIXL", "READINESS", "MIDDLEWARES", "OPEN_TENANT", "PEER", "PEER_PATHS", "PROBE_NIXL", "STORE",
           "TENANT", "control_header", "error_body", "error_response", "refusal_of", "frame_response", "owned", "read_body", "stalled"]
