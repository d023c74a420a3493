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

The cap also follows the process's descriptor limit (:func:`connection_cap`). Each connection
holds a descriptor, and one more while a get answer streams (store/sendbody.py sends from a
duplicate of its socket); past the soft ``RLIMIT_NOFILE`` accept() fails, and asyncio retries it
every second with a traceback each time, so a flood at a common container default (1024) saw no
503 at all, only a log growing by megabytes a second. At start the runner raises the soft limit
as far as the hard one allows and, when that is still short of ``max_connections``, lowers the
cap to what the limit leaves (logged once, naming both); a limit that leaves fewer than
``MIN_CONNECTIONS`` fails the start. The accept errors that other descriptor use may still cause
are counted (``prefixstore_accept_errors_total``) and logged a line at a time.

aiohttp answers a request it cannot parse with 400 itself and logs it with a
full traceback; anyone who can connect could flood the log that way.
:class:`_ParserLog` counts them (``prefixstore_malformed_requests_total``) and
logs one line, without the traceback (nor the request's bytes, which may hold a
token), at most every ``MALFORMED_LOG_EVERY_S``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import time
import weakref
from collections.abc import Callable
from typing import Any

from aiohttp import web

from .config import StoreConfig
from .http import STORE
from .knobs import ConfigError

log = logging.getLogger("prefixstore.server")
MALFORMED_LOG_EVERY_S = 10.0
ACCEPT_LOG_EVERY_S = 10.0
DESCRIPTORS_SPARE = 64
"""Descriptors kept free beside those open at start and the connections': LMDB's reader threads,
replica pushes and DNS lookups to peers, a log file rotated, /proc reads of the metrics."""
DESCRIPTORS_PER_CONNECTION = 2  # its socket, and the duplicate a streaming get answer sends from
MIN_CONNECTIONS = 8


def _open_descriptors() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: a generous guess
        return 64


def connection_cap(max_connections: int) -> tuple[int, str | None]:
    """The connection cap this process can honour, and why it is lower than ``max_connections``
    (None when it is not). Raises the soft RLIMIT_NOFILE towards the hard one as far as the cap
    needs; raises ConfigError naming the knob when the limit leaves fewer than MIN_CONNECTIONS."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    reserved = _open_descriptors() + DESCRIPTORS_SPARE
    need = reserved + DESCRIPTORS_PER_CONNECTION * max_connections
    if soft != resource.RLIM_INFINITY and soft < need and (hard == resource.RLIM_INFINITY or hard > soft):
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError) as err:  # a hard limit above the kernel's nr_open, say
            log.info("could not raise RLIMIT_NOFILE to %d: %s", raised, err)
    if soft == resource.RLIM_INFINITY:
        return max_connections, None
    room = (soft - reserved) // DESCRIPTORS_PER_CONNECTION
    limit = f"RLIMIT_NOFILE={soft} (hard {'unlimited' if hard == resource.RLIM_INFINITY else hard})"
    if room < MIN_CONNECTIONS:
        raise ConfigError(f"max_connections: the descriptor limit {limit} leaves room for {max(room, 0)} "
                          f"connections ({reserved} descriptors are the process's own); raise it (ulimit -n)")
    if room >= max_connections:
        return max_connections, None
    return room, (f"max_connections={max_connections} lowered to {room}: the descriptor limit {limit} leaves "
                  f"that many after the process's own {reserved} (a connection may hold "
                  f"{DESCRIPTORS_PER_CONNECTION} while a get answer streams); raise it (ulimit -n) to serve more")


class _ParserLog(logging.LoggerAdapter[logging.Logger]):
    """The logger aiohttp's connection handler is given: requests it could not parse are counted
    and logged one line at a time, rate-limited; everything else goes through unchanged.

    Every level goes through here, not only ``exception``: aiohttp logs a connection's first
    request with a bad method at DEBUG (scanners, TLS on the http port), with a traceback whose
    message is the raw request line -- which holds a bearer token when a client sent its
    Authorization header first. The line logged names the error class only, never the bytes."""

    def __init__(self, logger: logging.Logger, count: Callable[[], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(logger, {})
        self._count = count
        self._clock = clock
        self._next_s = 0.0
        self._quiet = 0

    def log(self, level: int, msg: object, *args: object, **kwargs: Any) -> None:
        if not (isinstance(msg, str) and msg.startswith("Error handling request")):
            super().log(level, msg, *args, **kwargs)
            return
        self._count()
        now = self._clock()
        if now < self._next_s:
            self._quiet += 1
            return
        self._next_s = now + MALFORMED_LOG_EVERY_S
        exc_info = kwargs.get("exc_info")
        err = exc_info if isinstance(exc_info, BaseException) else None
        # aiohttp's HttpProcessingError renders as "400, message:" and then the raw line: the
        # status and the class say what happened, the rest is the client's bytes.
        what = f"{type(err).__name__} ({getattr(err, 'code', '?')})" if err is not None else "unknown"
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


class _AcceptErrors:
    """The loop's exception handler while the store serves: asyncio reports every accept() that
    failed for want of descriptors (and retries a second later) with a traceback; those are
    counted and logged one line at a time. Anything else goes to the handler that was there."""

    def __init__(self, count: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self._count = count
        self._clock = clock
        self._next_s = 0.0
        self._quiet = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._previous: Callable[[asyncio.AbstractEventLoop, dict[str, Any]], object] | None = None

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop, self._previous = loop, loop.get_exception_handler()
        loop.set_exception_handler(self)

    def uninstall(self) -> None:
        if self._loop is not None and self._loop.get_exception_handler() is self:
            self._loop.set_exception_handler(self._previous)
        self._loop = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if not str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        self._count()
        now = self._clock()
        if now < self._next_s:
            self._quiet += 1
            return
        self._next_s = now + ACCEPT_LOG_EVERY_S
        err = context.get("exception")
        log.warning("socket.accept() out of system resource (%s): no descriptor for a new connection; retried "
                    "in a second (%d more since the last such line, not logged; see max_connections)",
                    type(err).__name__ if err is not None else "unknown", self._quiet)
        self._quiet = 0


class StoreRunner(web.AppRunner):
    """``web.AppRunner`` for a store app: access log off, head deadline and connection cap from the
    config (the cap lowered to what the descriptor limit allows: :func:`connection_cap`)."""

    def __init__(self, app: web.Application, config: StoreConfig, **kwargs: Any) -> None:
        kwargs.setdefault("access_log", None)
        kwargs.setdefault("logger", _ParserLog(log, lambda: app[STORE].metrics.malformed_requests.inc()))
        super().__init__(app, keepalive_timeout=config.header_timeout_s, **kwargs)
        self._config = config
        self._accept_errors = _AcceptErrors(lambda: app[STORE].metrics.accept_errors.inc())
        self.max_connections = config.max_connections  # the cap in force, once set up

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()  # runs the app's startup: the store is open now
        metrics = self.app[STORE].metrics
        self.max_connections, why = connection_cap(self._config.max_connections)  # after LMDB opened its files
        if why is not None:
            log.warning("%s", why)
        metrics.max_connections.set(self.max_connections)
        limiter = _ConnectionLimiter(server, self.max_connections, metrics.connections_refused.inc)
        metrics.connections.set_function(limiter.open_connections)
        self._accept_errors.install(asyncio.get_running_loop())
        return limiter  # type: ignore[return-value]  # a web.Server in every way the runner uses

    async def _cleanup_server(self) -> None:
        self._accept_errors.uninstall()
        await super()._cleanup_server()
