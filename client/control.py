"""The client's end of the control channel (protocol/control.py): one WebSocket to a node that
carries its lookups and probes, each as one binary message, answers matched to calls by id.

The channel is an optimisation, never a requirement. :meth:`ControlChannel.call` answers None
where the channel cannot carry the call, and the caller sends it as a POST (transport/frames.py):

* the node has no channel (an older store answers the upgrade 404, or the call's op 404), a
  proxy refuses the upgrade, or the upgrade is not answered within ``timeout_s``: no further
  try for ``RETRY_S``;
* the channel broke before the call's answer came (the node restarted, closed an idle channel,
  the connection dropped): the next call opens a new one; a call lost so is sent again as a POST,
  so a lookup may take a second lease (the first one expires, ``lease_ttl_s``).

A call the node answered with a refusal raises the same :class:`StoreError` as the POST would.
A call not answered within ``timeout_s`` raises the POST's timeout error and closes the channel
(a flow that went silent, a NAT that forgot it, is never waited on twice); no resend: a node that
slow would be as slow to a POST.

Each opened WebSocket is a :class:`Link` with its own calls in flight, so the end of an old one
fails only the calls sent on it. A client used from another event loop than the one its channel
was opened on opens a new one there (aiohttp's session belongs to one loop).

No task reads the channel in the background: the calls waiting for answers read them, one at a
time, each handing every answer it reads to the call it belongs to (the node answers in order,
so a call mostly reads its own). An idle channel thus holds no pending task, so a client an
engine drops without closing leaves no coroutine suspended in the WebSocket reader for the
garbage collector to finalise on another thread (CPython 3.11 crashed doing that: a test run
here died in ``gen_close`` one time in five). The price: a node's idle close (``header_timeout_s``)
is seen by the next call, which then goes as a POST, and the call after it opens a new channel.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

import aiohttp
from prefixstore.protocol.control import ANSWER, CALL, CONTROL_PATH, op_of
from prefixstore.protocol.errors import Problem, StoreError
from prefixstore.protocol.wire import (
    PREFIX_BYTES,
    WireError,
    decode_frame,
    encode_frame,
)
from prefixstore.transport.frames import MAX_ANSWER_HEADER_BYTES, FramePool, refusal

RETRY_S: Final = 30.0
"""After the channel could not be opened, calls go as POSTs for this long before the next try."""
CLOSE_S: Final = 1.0
"""How long closing a channel waits for the node's close frame before dropping the connection."""


class CallTimedOut(Exception):
    """A call's deadline passed before its answer came (the watchdog's verdict, :meth:`ControlChannel.call`)."""


@dataclass(eq=False)
class Link:
    """One opened WebSocket and the calls sent on it."""

    ws: aiohttp.ClientWebSocketResponse
    pending: dict[int, asyncio.Future[tuple[int, bytes]]] = field(default_factory=dict)
    reading: asyncio.Lock = field(default_factory=asyncio.Lock)
    """Held by the call that reads the next answer."""
    deadlines: dict[int, float] = field(default_factory=dict)
    """Each pending call's deadline (the loop's clock)."""
    sending: dict[int, asyncio.Task[object]] = field(default_factory=dict)
    """The calls inside ``send_bytes`` (by their tasks): a send waiting for the socket to drain
    wakes only if cancelled, so the channel's end cancels them (``interrupted``)."""
    interrupted: set[int] = field(default_factory=set)
    """Calls whose tasks the channel cancelled (:meth:`ControlChannel.interrupt`)."""
    watchdog: asyncio.TimerHandle | None = None
    """Armed while calls may be pending (:meth:`ControlChannel.watch`): one timer for the channel,
    not one per call."""

    @property
    def open(self) -> bool:
        return not self.ws.closed


class ControlChannel:
    def __init__(self, pool: FramePool, *, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.clock = clock
        parts = urllib.parse.urlsplit(pool.url)
        self.url = f"{parts.scheme}://{pool.netloc}{pool.base_path}{CONTROL_PATH}"
        self._session: aiohttp.ClientSession | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._link: Link | None = None
        self._opening: asyncio.Task[Link | None] | None = None
        self._ids = itertools.count(1)
        self._closing: set[asyncio.Task[None]] = set()
        self.retry_at = -float("inf")
        self.opened = 0  # channels opened (tests, diagnostics)
        self.carried = 0  # calls answered over the channel

    @property
    def open(self) -> bool:
        return self._link is not None and self._link.open

    async def call(self, path: str, header: dict[str, object]) -> dict[str, object] | None:
        """The answer's header, or None where the channel cannot carry this call (send it as a POST).
        Raises StoreError for a refusal or a timeout, as the POST would.

        The whole call is bounded by ``timeout_s``: opening a channel by a timeout of its own (rare),
        the send and the answer by the channel's watchdog (:meth:`watch`), which ends the channel
        when a call's deadline passes. A timer per call (``asyncio.timeout``) cost 0.05-0.09 ms of a
        lookup after an idle pause here, a tenth of it (docs/benchmarks.md, issue 33)."""
        op = op_of(path)
        if op is None:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        link = self._link
        if link is None or not link.open or self._loop is not loop:
            try:
                async with asyncio.timeout_at(deadline):
                    link = await self._ensure()
            except TimeoutError:
                raise self._timed_out(path) from None
            if link is None:
                return None
            if loop.time() >= deadline:  # opened just at its deadline: not sent at all
                raise self._timed_out(path)
        call_id = next(self._ids) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, bytes]] = loop.create_future()
        link.pending[call_id] = future
        link.deadlines[call_id] = deadline
        if link.watchdog is None or deadline < link.watchdog.when():  # (a call that began first, then waited to open)
            if link.watchdog is not None:
                link.watchdog.cancel()
            link.watchdog = loop.call_at(deadline, self.watch, link)
        task = asyncio.current_task()
        cancels = task.cancelling() if task is not None else 0  # asked of this task before this call
        in_send = False
        try:
            if task is not None:
                link.sending[call_id] = task
            in_send = True
            try:
                await link.ws.send_bytes(encode_frame(header, lead=CALL.pack(call_id, op)))
            finally:
                link.sending.pop(call_id, None)
            in_send = False
            status, body = await self._answer(link, future)
        except asyncio.CancelledError:
            if not in_send or task is None:
                raise  # an outside cancel while the answer was awaited: the channel stays
            # A cancel in the send: the channel's end (interrupt), this call's caller, or another
            # call's caller (aiohttp's senders on one connection share one drain waiter, and
            # cancelling one sender cancels it for all). The drain waiter is spent either way:
            # the channel ends. Only a cancel someone asked of this task goes on up.
            if call_id in link.interrupted:
                task.uncancel()
            self._end(link)
            if task.cancelling() > cancels:
                raise
            self._raise_if_timed_out(path, future, deadline)
            return None
        except Exception:  # noqa: BLE001 - the channel broke under this call: the caller POSTs it
            self._drop(link)
            self._raise_if_timed_out(path, future, deadline)
            return None
        finally:
            link.pending.pop(call_id, None)
            link.deadlines.pop(call_id, None)
            link.interrupted.discard(call_id)
        if status != 200:
            err = refusal(path, status, body)
            if err.is_refusal(Problem.UNKNOWN, "op"):
                return None  # a node that does not carry this call on its channel: a POST
            raise err
        try:
            answer, _ = decode_frame(body, MAX_ANSWER_HEADER_BYTES)
        except WireError as err:
            raise StoreError(path, f"malformed answer: {err}", problem=Problem.UNAVAILABLE) from err
        self.carried += 1
        return answer

    def _raise_if_timed_out(self, path: str, future: asyncio.Future[tuple[int, bytes]], deadline: float) -> None:
        """A call its channel could not carry to the end goes as a POST, unless its deadline passed
        (the watchdog said so, or it is simply past): then the timeout error, never a resend past
        its deadline."""
        if (future.done() and not future.cancelled() and isinstance(future.exception(), CallTimedOut)) \
                or asyncio.get_running_loop().time() >= deadline:
            raise self._timed_out(path) from None

    def _timed_out(self, path: str) -> StoreError:
        return StoreError(path, f"no complete answer within timeout_s={self.timeout_s}", problem=Problem.TIMEOUT)

    def watch(self, link: Link) -> None:
        """The channel's watchdog: a call past its deadline fails with CallTimedOut and ends the
        channel (its other calls go as POSTs; a flow that went silent is never waited on twice);
        otherwise it sleeps until the earliest deadline of the calls still pending, if any."""
        link.watchdog = None
        if not link.deadlines:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        expired = [call_id for call_id, deadline in link.deadlines.items() if deadline <= now]
        if not expired:
            link.watchdog = loop.call_at(min(link.deadlines.values()), self.watch, link)
            return
        for call_id in expired:
            future = link.pending.get(call_id)
            if future is not None and not future.done():
                future.set_exception(CallTimedOut())
        # Ending it wakes a call that waits to read (the close feeds its reader the closing
        # message) or to send (interrupt); a close not answered within CLOSE_S shuts the socket.
        self._end(link)

    async def _ensure(self) -> Link | None:
        """The open channel, opening one if it is time to try; None: send as a POST."""
        loop = asyncio.get_running_loop()
        if self._loop is not loop:  # a new event loop: what the old one held cannot be used here
            self._loop, self._session, self._link, self._opening = loop, None, None, None
        link = self._link
        if link is not None and link.open:
            return link
        if self.clock() < self.retry_at or self.pool.closed:
            return None
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if opening.cancelled() and (task is None or not task.cancelling()):
                return None  # the channel was closed while it opened (close()), not this call
            raise
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _open(self) -> Link | None:
        pool = self.pool
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, connect=pool.connect_timeout_s, sock_connect=pool.connect_timeout_s))
        headers = {"Authorization": pool.authorization} if pool.authorization else {}
        try:
            async with asyncio.timeout(self.timeout_s):  # an upgrade nobody answers is not waited on
                ws = await self._session.ws_connect(
                    self.url, headers=headers, ssl=pool.ssl_context if pool.ssl_context else True,
                    max_msg_size=ANSWER.size + PREFIX_BYTES + MAX_ANSWER_HEADER_BYTES, autoping=True)
        except Exception:  # noqa: BLE001 - any failure to open it (refused, 404, no answer, an aiohttp race): POSTs
            self.retry_at = self.clock() + RETRY_S
            return None
        link = Link(ws)
        self._link = link
        self.opened += 1
        return link

    async def _answer(self, link: Link, future: asyncio.Future[tuple[int, bytes]]) -> tuple[int, bytes]:
        """This call's answer: read answers (one reader at a time), each to its call, until it came.
        Raises ConnectionResetError where the channel ended first."""
        while not future.done():
            async with link.reading:
                if future.done():
                    break
                msg = await link.ws.receive()
                if msg.type is not aiohttp.WSMsgType.BINARY or len(msg.data) < ANSWER.size:
                    self._end(link)  # closed, or not an answer: not a channel to trust further
                    break
                call_id, status = ANSWER.unpack_from(msg.data)
                waiting = link.pending.get(call_id)
                if waiting is not None and not waiting.done():
                    waiting.set_result((status, msg.data[ANSWER.size:]))
        return future.result()

    def _end(self, link: Link) -> None:
        """The channel ended: drop it and fail the calls sent on it."""
        self._drop(link)
        for future in list(link.pending.values()):
            if not future.done():
                future.set_exception(ConnectionResetError("the control channel closed"))
        self.interrupt(link)

    @staticmethod
    def interrupt(link: Link) -> None:
        """Wake the calls still inside ``send_bytes`` on a channel that ended: a send parked until
        the socket drains (a node that stopped reading) wakes only if cancelled; closing the
        connection does not wake it while its buffer holds data. Each then ends as its future
        says (a timeout, or a POST)."""
        for call_id, task in list(link.sending.items()):
            if call_id not in link.interrupted:
                link.interrupted.add(call_id)
                task.cancel()

    def _drop(self, link: Link) -> None:
        """Stop using ``link`` (the next call opens a new channel) and close it in the background."""
        if self._link is link:
            self._link = None
        if not link.ws.closed:
            task = asyncio.ensure_future(self.close_link(link))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    @staticmethod
    async def close_link(link: Link) -> None:
        """Close the channel; one whose node takes no close frame within CLOSE_S has its socket
        shut: aiohttp then closes the connection gracefully, which waits, with every frame still
        buffered, for a node that may never read again."""
        sock = link.ws.get_extra_info("socket")
        try:
            await asyncio.wait_for(link.ws.close(), CLOSE_S)
        except (TimeoutError, aiohttp.ClientError, ConnectionError):
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    async def close(self) -> None:
        if self._loop is not asyncio.get_running_loop():
            # Opened on another event loop (closed or not): nothing of it can be awaited here.
            self._session, self._link, self._opening, self._loop = None, None, None, None
            self._closing.clear()
            return
        opening, self._opening = self._opening, None
        if opening is not None:
            opening.cancel()
            await asyncio.gather(opening, return_exceptions=True)
        link, self._link = self._link, None
        if link is not None:
            if link.watchdog is not None:
                link.watchdog.cancel()
                link.watchdog = None
            self._end(link)  # its calls go as POSTs (parked sends woken); closed in the background, awaited below
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._session is not None and self._loop is asyncio.get_running_loop():
            await self._session.close()
        self._session = None


__all__ = ["CLOSE_S", "RETRY_S", "CallTimedOut", "ControlChannel", "Link"]
