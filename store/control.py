"""``GET /v1/control``: the control channel, a WebSocket carrying lookups and probes (protocol/control.py).

The upgrade is an HTTP request like any other: the middlewares refuse it without a valid tenant
token (store/http.py ``authenticate``; the admin and cluster tokens open no channel), and this
handler refuses it from a web page (an ``Origin`` header: browsers may open WebSockets to any
host). The upgrade itself is not counted as a request; each call on the channel is, once
answered by the same function as its POST route (``CONTROL_CALLS``), under the same rules:

* the caller is the tenant its token named at the upgrade (tokens are read at start, as for
  every request; a restart, which closes every channel, is what revokes one);
* a refusal is the POST's status and JSON body; an op the channel does not carry is a 404 naming
  ``op`` (a newer client then sends that call as a POST);
* every call is counted in ``prefixstore_requests_total`` and the request-time histogram under
  its POST path, and in the access log when it is on (``WS /v1/lookup``);
* a message larger than ``max_header_bytes`` (plus its few bytes of framing) closes the channel
  (1009); the client then sends that call as a POST, which is refused with its 413.

A channel holds a connection slot (``max_connections``) as a kept-alive connection does, and is
held no longer: one idle for ``header_timeout_s`` is closed (1000), so idle channels cannot keep
a node's slots. A client that goes away while its answer is sent ends its channel quietly.

Calls are answered one after the other in the order they came: each is answered at once from
the index (no payload, nothing awaited), as the POST handlers do. A store shutting down closes
every open channel (1001), each within ``CLOSE_S`` or its connection is dropped, before it waits
for requests in flight.
"""

from __future__ import annotations

import asyncio
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
    error_body,
    error_response,
    refusal_of,
)

log = logging.getLogger(__name__)

CHANNELS: web.AppKey[dict[web.WebSocketResponse, web.Request]] = web.AppKey("control_channels")
"""The open channels and their upgrade requests (each leaves when its handler ends)."""
CLOSE_S = 1.0
"""At shutdown, how long a channel's close may take before its connection is dropped."""


async def control(request: web.Request) -> web.StreamResponse:
    store = request.app[STORE]
    if "Origin" in request.headers:
        return error_response(403, "origin", "requests from web pages are refused (this store has no browser API)")
    max_header = store.config.max_header_bytes
    ws = web.WebSocketResponse(max_msg_size=CALL.size + PREFIX_BYTES + max_header, timeout=CLOSE_S, compress=False)
    if not ws.can_prepare(request).ok:
        return error_response(400, "upgrade", f"{CONTROL_PATH} is a WebSocket (Upgrade: websocket)")
    try:
        await ws.prepare(request)
    except ConnectionError:
        return ws  # the client went away during the upgrade
    channels = request.app[CHANNELS]
    channels[ws] = request
    store.metrics.control_channels.inc()
    try:
        await serve_calls(request, ws, max_header)
    except ConnectionError:
        pass  # the client went away (while its answer was sent): nothing to answer any more
    except Exception:
        log.exception("unexpected error on a control channel; it is closed, the store keeps serving")
        if not ws.closed:
            await ws.close(code=WSCloseCode.INTERNAL_ERROR, message=b"internal error (logged)")
    finally:
        channels.pop(ws, None)
        store.metrics.control_channels.dec()
    return ws


async def serve_calls(request: web.Request, ws: web.WebSocketResponse, max_header: int) -> None:
    """Answer the channel's calls in order until it closes or idles ``header_timeout_s``."""
    idle_s = request.app[STORE].config.header_timeout_s
    while True:
        try:
            msg = await ws.receive(timeout=idle_s)
        except TimeoutError:
            await ws.close(code=WSCloseCode.OK, message=b"idle past header_timeout_s")
            return
        if msg.type in (WSMsgType.CLOSE, WSMsgType.CLOSING, WSMsgType.CLOSED, WSMsgType.ERROR):
            return
        if msg.type is not WSMsgType.BINARY:
            await ws.close(code=WSCloseCode.UNSUPPORTED_DATA, message=b"binary messages only")
            return
        if len(msg.data) < CALL.size:
            await ws.close(code=WSCloseCode.PROTOCOL_ERROR, message=b"a call is shorter than its id and op")
            return
        await ws.send_bytes(answer_call(request, msg.data, max_header))


def answer_call(request: web.Request, data: bytes, max_header: int) -> bytes:
    """One call's answer message."""
    store = request.app[STORE]
    started = time.perf_counter()
    call_id, op = CALL.unpack_from(data)
    path = path_of(op)
    answerer = request.app[CONTROL_CALLS].get(path) if path is not None else None
    if answerer is None or path is None:
        path = "unknown"
        status, body = 404, error_body("op", f"{op} is not a call of this store's control channel")
    else:
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
    return ANSWER.pack(call_id, status) + body


async def close_channels(app: web.Application) -> None:
    """On shutdown: an open channel is a handler that would run until its client left. Each is
    closed at once; one whose client does not take the close frame (it reads nothing) within
    ``CLOSE_S`` has its connection dropped."""
    channels: dict[web.WebSocketResponse, web.Request] = app[CHANNELS]
    open_now = list(channels.items())

    async def close(ws: web.WebSocketResponse, request: web.Request) -> None:
        try:
            await asyncio.wait_for(ws.close(code=WSCloseCode.GOING_AWAY, message=b"the store is shutting down"),
                                   CLOSE_S)
        except (TimeoutError, ConnectionError):
            if request.transport is not None:
                request.transport.abort()
    await asyncio.gather(*(close(ws, request) for ws, request in open_now))


def install(app: web.Application) -> None:
    channels: dict[web.WebSocketResponse, web.Request] = {}
    app[CHANNELS] = channels
    app.router.add_get(CONTROL_PATH, control)
    app.on_shutdown.append(close_channels)


__all__ = ["CHANNELS", "CLOSE_S", "answer_call", "install", "serve_calls"]
