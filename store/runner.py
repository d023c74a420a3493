"""How the store is served: an aiohttp runner with connection limits.

aiohttp alone holds every connection a client opens for as long as the client
likes, and never times out a request head that arrives a byte at a time. Two
knobs close those holes, both enforced here, in the one runner that both
``prefixstore serve`` and the tests use:

* ``max_connections`` -- the protocol factory the listener calls for every
  accepted socket counts the connections open (established ones, plus the
  ones accepted whose ``connection_made`` has not run yet, e.g. mid TLS
  handshake; see :class:`_ConnectionLimiter`) and, at the cap, hands the
  socket to :class:`_Refuse`, which
  writes one ``503`` naming the knob and closes, reading nothing. Refusals
  are counted (``prefixstore_connections_refused_total``).
* ``header_timeout_s`` -- aiohttp arms its keep-alive timer when a connection
  opens and re-arms it after each answer; when it fires while the connection
  is still waiting for a complete request head, the connection is closed.
  Setting that timer to ``header_timeout_s`` is therefore exactly a head
  deadline: a slowloris client that never completes its head is cut off, and
  an idle keep-alive connection is closed after the same time. Bodies have
  their own deadline (``request_timeout_s``, store/server.py).

aiohttp answers a request it cannot parse with 400 itself and logs it with a
full traceback; anyone who can connect could flood the log that way.
:class:`_ParserLog` counts them (``prefixstore_malformed_requests_total``) and
logs one line, without the traceback, at most every ``MALFORMED_LOG_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .config import StoreConfig
from .http import STORE

log = logging.getLogger("prefixstore.server")
MALFORMED_LOG_EVERY_S = 10.0


class _ParserLog(logging.LoggerAdapter[logging.Logger]):
    """The logger aiohttp's connection handler is given: requests it could not parse are counted
    and logged one line at a time, rate-limited; everything else goes through unchanged."""

    def __init__(self, logger: logging.Logger, count: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logger, {})
        self._count = count
        self._clock = clock
        self._next_s = 0.0
        self._quiet = 0

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if not (isinstance(msg, str) and msg.startswith("Error handling request")):
            self.logger.error(msg, *args, exc_info=exc_info, **kwargs)
            return
        self._count()
        now = self._clock()
        if now < self._next_s:
            self._quiet += 1
            return
        self._next_s = now + MALFORMED_LOG_EVERY_S
        err = exc_info if isinstance(exc_info, BaseException) else None
        what = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}" if err else "unknown"
        self.logger.warning("%s: %s (answered 400; %d more since the last such line, not logged)",
                            msg % args if args else msg, what, self._quiet)
        self._quiet = 0


class _Refuse(asyncio.Protocol):
    """A connection over the cap: one 503 naming the knob, then close. Reads nothing."""

    def __init__(self, limit: int) -> None:
        self._limit = limit

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        body = json.dumps({"error": f"too many connections (max_connections={self._limit}); retry later",
                           "field": "max_connections"}).encode()
        head = (f"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n").encode()
        assert isinstance(transport, asyncio.WriteTransport)
        transport.write(head + body)
        transport.close()  # flushes the answer, then closes

    def data_received(self, data: bytes) -> None:  # pragma: no cover - closed before anything is read
        pass


class _Counted(asyncio.Protocol):
    """aiohttp's protocol for one connection, forwarded to, with its open/close counted."""

    def __init__(self, limiter: _ConnectionLimiter, inner: asyncio.Protocol) -> None:
        self._limiter = limiter
        self._inner = inner
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._limiter.established(self)
        self._counted = True
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._counted:
            self._counted = False
            self._limiter.closed()
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class _ConnectionLimiter:
    """The listener's protocol factory: aiohttp's server below the cap, :class:`_Refuse` at it.

    Open connections = established ones (counted from ``connection_made`` to
    ``connection_lost``) + accepted ones whose ``connection_made`` has not run
    yet (mid TLS handshake, or queued behind other accepts). The latter are
    held weakly: a connection whose TLS handshake fails never sees
    ``connection_made`` nor ``connection_lost``, and stops counting once the
    event loop has dropped it. Everything else is delegated to the wrapped
    ``web.Server`` (the runner shuts it down).
    """

    def __init__(self, server: web.Server, limit: int, on_refuse: Any) -> None:
        self._server = server
        self._limit = limit
        self._on_refuse = on_refuse
        self._established = 0
        self._starting: weakref.WeakSet[_Counted] = weakref.WeakSet()
        self._warned = False

    def open_connections(self) -> int:
        return self._established + len(self._starting)

    def established(self, conn: _Counted) -> None:
        self._starting.discard(conn)
        self._established += 1

    def closed(self) -> None:
        self._established -= 1

    def __call__(self) -> asyncio.BaseProtocol:
        if self.open_connections() >= self._limit:
            self._on_refuse()
            if not self._warned:
                log.warning("refusing connections: max_connections=%d are open", self._limit)
                self._warned = True
            return _Refuse(self._limit)
        self._warned = False
        conn = _Counted(self, self._server())
        self._starting.add(conn)
        return conn

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class StoreRunner(web.AppRunner):
    """``web.AppRunner`` for a store app: access log off, head deadline and connection cap from the config."""

    def __init__(self, app: web.Application, config: StoreConfig, **kwargs: Any) -> None:
        kwargs.setdefault("access_log", None)
        kwargs.setdefault("logger", _ParserLog(log, lambda: app[STORE].metrics.malformed_requests.inc()))
        super().__init__(app, keepalive_timeout=config.header_timeout_s, **kwargs)
        self._config = config

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's startup: the store is open now
        metrics = self.app[STORE].metrics
        limiter = _ConnectionLimiter(server, self._config.max_connections, metrics.connections_refused.inc)
        metrics.connections.set_function(limiter.open_connections)
        return limiter  # type: ignore[return-value]  # a web.Server in every way the runner uses
