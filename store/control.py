"""``GET /v1/control``: the control channel, a WebSocket carrying lookups and probes (protocol/control.py).

The upgrade is an HTTP request like any other: the middlewares count it, refuse it without a
valid bearer token (store/http.py ``authenticate``) and refuse it from a web page (an ``Origin``
header: browsers may open WebSockets to any host). Each call on the channel is then answered by
the same function as its POST route (``CONTROL_CALLS``), under the same rules:

* the caller's token is checked again at every call, so a token taken out of the tenants file
  stops working on an open channel as it does on a new request (401, and the channel is closed);
* a refusal is the POST's status and JSON body; a call the channel does not carry is a 404;
* every call is counted in ``prefixstore_requests_total`` and the request-time histogram under
  its POST path, and in the access log when it is on, so dashboards see one lookup either way;
* a message larger than ``max_header_bytes`` (plus its few bytes of framing) closes the channel
  (1009); the client then sends that call as a POST, which is refused with its 413.

Calls are answered one after the other in the order they came: each is answered at once from
the index (no payload, nothing awaited), as the POST handlers do. A store shutting down closes
every open channel (1001) before it waits for requests in flight.
"""

from __future__ import annotations

import logging
import time

from aiohttp import WSCloseCode, WSMsgType, web
from prefixstore.protocol.control import ANSWER, CALL, CONTROL_PATH, path_of
from prefixstore.protocol.wire import (
    PREFIX_BYTES,
    WireError,
    decode_frame,
    encode_frame,
)

from .http import (
    CONTROL_CALLS,
    STORE,
    TENANT,
    access_log,
    bearer,
    error_body,
    error_response,
    refusal_of,
)

log = logging.getLogger(__name__)

CHANNELS: web.AppKey[set[web.WebSocketResponse]] = web.AppKey("control_channels")
"""The open channels (each leaves the set when its handler ends)."""


async def control(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    if "Origin" in request.headers:
        return error_response(403, "origin", "requests from web pages are refused (this store has no browser API)")
    max_header = store.config.max_header_bytes
    ws = web.WebSocketResponse(max_msg_size=CALL.size + PREFIX_BYTES + max_header)
    if not ws.can_prepare(request).ok:
        return error_response(400, "upgrade", f"{CONTROL_PATH} is a WebSocket (Upgrade: websocket)")
    await ws.prepare(request)
    channels = request.app[CHANNELS]
    channels.add(ws)
    token = bearer(request)
    try:
        async for msg in ws:
            if msg.type is not WSMsgType.BINARY:
                await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"binary messages only")
                break
            if len(msg.data) < CALL.size:
                await ws.close(code=WSCloseCode.PROTOCOL_ERROR, message=b"a call is shorter than its id and op")
                break
            answer, authorized = answer_call(request, token, msg.data, max_header)
            await ws.send_bytes(answer)
            if not authorized:
                await ws.close(code=WSCloseCode.POLICY_VIOLATION, message=b"the bearer token is no longer valid")
                break
    finally:
        channels.discard(ws)
    return ws


def answer_call(request: web.Request, token: str | None, data: bytes, max_header: int) -> tuple[bytes, bool]:
    """One call's answer message, and whether the caller's token is still valid."""
    store = request.app[STORE]
    started = time.perf_counter()
    call_id, op = CALL.unpack_from(data)
    path = path_of(op)
    answerer = request.app[CONTROL_CALLS].get(path) if path is not None else None
    tenant = store.tenants.authenticate(token) if store.tenants is not None and token is not None else None
    authorized = store.tenants is None or tenant is not None
    if answerer is None or path is None:
        path = "unknown"
        status, body = 404, error_body("op", f"{op} is not a call of this store's control channel")
    elif not authorized:
        store.metrics.auth_failures.inc()
        status, body = 401, error_body("authorization", "unknown bearer token")
    else:
        if tenant is not None:
            request[TENANT] = tenant.name
        try:
            header, rest = decode_frame(memoryview(data)[CALL.size:], max_header)
            if len(rest):
                raise WireError("frame", f"{len(rest)} bytes follow the header of a request that carries no payload")
            status, body = 200, encode_frame(answerer(request, header))
        except Exception as err:  # every failure is an answer; the channel keeps serving
            refused = refusal_of(err)
            if refused is None:
                log.exception("unexpected error serving %s on the control channel", path)
                refused = (500, "server", "internal error (logged); the store keeps serving")
            status, body = refused[0], error_body(refused[1], refused[2])
    elapsed_s = time.perf_counter() - started
    store.metrics.observe_request(path, status, elapsed_s)
    config = store.config
    slow = 0 < config.slow_request_s < elapsed_s
    if config.access_log or slow:
        tenant_name = request.get(TENANT)
        access_log.log(logging.WARNING if slow else logging.INFO,
                       "%sWS %s tenant=%s status=%d in=%dB out=%dB %.3fms peer=%s", "slow request: " if slow else "",
                       path, tenant_name or "-", status, len(data), len(body), elapsed_s * 1000, request.remote or "-",
                       extra={"access": {"method": "WS", "endpoint": path, "tenant": tenant_name or "-",
                                         "status": status, "bytes_in": len(data), "bytes_out": len(body),
                                         "ms": round(elapsed_s * 1000, 3), "peer": request.remote or "-"}})
    return ANSWER.pack(call_id, status) + body, authorized


async def close_channels(app: web.Application) -> None:
    """On shutdown: an open channel is a handler that would run until its client left."""
    channels: set[web.WebSocketResponse] = app[CHANNELS]
    for ws in [*channels]:
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"the store is shutting down")


def install(app: web.Application) -> None:
    channels: set[web.WebSocketResponse] = set()
    app[CHANNELS] = channels
    app.router.add_get(CONTROL_PATH, control)
    app.on_shutdown.append(close_channels)


__all__ = ["CHANNELS", "answer_call", "install"]
