"""The client's end of the control channel (protocol/control.py): one WebSocket to a node that
carries its lookups and probes, each as one binary message, answers matched to calls by id.

The channel is an optimisation, never a requirement. :meth:`ControlChannel.call` answers None
where the channel cannot carry the call, and the caller sends it as a POST (transport/frames.py):

* the node has no channel (an older store answers the upgrade 404), or a proxy refuses the
  upgrade: no further try for ``RETRY_S``;
* the channel broke before the call's answer came (the node restarted, the connection dropped):
  the next call opens a new one; a call lost so is sent again as a POST, so a lookup may take a
  second lease (the first one expires, ``lease_s``).

A call the node answered with a refusal raises the same :class:`StoreError` as the POST would;
a call not answered within ``timeout_s`` raises the POST's timeout error (no resend: the node is
slow, a POST would be too).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable
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


class ControlChannel:
    def __init__(self, pool: FramePool, *, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.pool = pool
        self.timeout_s = timeout_s
        self.clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._reader: asyncio.Task[None] | None = None
        self._opening: asyncio.Task[bool] | None = None
        self._pending: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self._ids = itertools.count(1)
        self.retry_at = -float("inf")
        self.opened = 0  # channels opened (tests, diagnostics)
        self.carried = 0  # calls answered over the channel

    @property
    def open(self) -> bool:
        return self._ws is not None and not self._ws.closed

    async def call(self, path: str, header: dict[str, object]) -> dict[str, object] | None:
        """The answer's header, or None where the channel cannot carry this call (send it as a POST).
        Raises StoreError for a refusal or a timeout, as the POST would."""
        op = op_of(path)
        if op is None or not await self._ensure():
            return None
        ws = self._ws
        assert ws is not None
        call_id = next(self._ids) & 0xFFFFFFFF
        future: asyncio.Future[tuple[int, bytes]] = asyncio.get_running_loop().create_future()
        self._pending[call_id] = future
        try:
            try:
                await ws.send_bytes(CALL.pack(call_id, op) + encode_frame(header))
                async with asyncio.timeout(self.timeout_s):
                    status, body = await future
            except (ConnectionError, aiohttp.ClientError, RuntimeError):
                self._drop()
                return None  # the channel broke: the caller sends it as a POST
        except TimeoutError:
            raise StoreError(path, f"no complete answer within timeout_s={self.timeout_s}",
                             problem=Problem.TIMEOUT) from None
        finally:
            self._pending.pop(call_id, None)
        if status != 200:
            raise refusal(path, status, body)
        try:
            answer, _ = decode_frame(body, MAX_ANSWER_HEADER_BYTES)
        except WireError as err:
            raise StoreError(path, f"malformed answer: {err}", problem=Problem.UNAVAILABLE) from err
        self.carried += 1
        return answer

    async def _ensure(self) -> bool:
        """Whether a channel is open, opening one if it is time to try."""
        if self.open:
            return True
        if self.clock() < self.retry_at or self.pool.closed:
            return False
        if self._opening is None:
            self._opening = asyncio.ensure_future(self._open())
        opening = self._opening
        try:
            return await asyncio.shield(opening)
        finally:
            if opening.done() and self._opening is opening:
                self._opening = None

    async def _open(self) -> bool:
        pool = self.pool
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(
                total=None, connect=pool.connect_timeout_s, sock_connect=pool.connect_timeout_s))
        headers = {"Authorization": pool.authorization} if pool.authorization else {}
        try:
            ws = await self._session.ws_connect(
                pool.url + CONTROL_PATH, headers=headers, ssl=pool.ssl_context if pool.ssl_context else True,
                max_msg_size=ANSWER.size + PREFIX_BYTES + MAX_ANSWER_HEADER_BYTES, autoping=True,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=1.0))
        except (aiohttp.ClientError, OSError, TimeoutError):
            self.retry_at = self.clock() + RETRY_S
            return False
        self._ws = ws
        self.opened += 1
        self._reader = asyncio.ensure_future(self._read(ws))
        return True

    async def _read(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        """Hand each answer to its call, until the channel closes; then fail the calls left."""
        try:
            async for msg in ws:
                if msg.type is not aiohttp.WSMsgType.BINARY or len(msg.data) < ANSWER.size:
                    break
                call_id, status = ANSWER.unpack_from(msg.data)
                future = self._pending.get(call_id)
                if future is not None and not future.done():
                    future.set_result((status, msg.data[ANSWER.size:]))
        finally:
            if self._ws is ws:
                self._ws = None
            for future in list(self._pending.values()):
                if not future.done():
                    future.set_exception(ConnectionResetError("the control channel closed"))

    def _drop(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None and not ws.closed:
            asyncio.ensure_future(ws.close())

    async def close(self) -> None:
        ws, self._ws = self._ws, None
        if ws is not None:
            await ws.close()
        if self._reader is not None:
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._opening is not None:
            self._opening.cancel()
            await asyncio.gather(self._opening, return_exceptions=True)
            self._opening = None
        if self._session is not None:
            await self._session.close()
            self._session = None


__all__ = ["RETRY_S", "ControlChannel"]
