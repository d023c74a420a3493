"""Reading a framed body from a stream into caller-provided buffers.

Used by the server (put bodies into arena pages): one copy from the chunks
aiohttp hands over into the destination, no intermediate ``bytes`` per
payload. The client reads get bodies on its own bulk path
(``client/bulk.py``), which receives into the destination directly.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from prefixstore.protocol.wire import PREFIX_BYTES, decode_header, parse_prefix


class ChunkSource(Protocol):
    async def readany(self) -> bytes: ...


class FrameReader:
    def __init__(self, source: ChunkSource) -> None:
        self._source = source
        self._chunk = b""
        self._pos = 0

    async def _fill(self) -> None:
        if self._pos >= len(self._chunk):
            self._chunk = await self._source.readany()
            self._pos = 0
            if not self._chunk:
                raise asyncio.IncompleteReadError(b"", None)

    async def readinto(self, views: list[memoryview]) -> None:
        """Fill every view completely, in order; IncompleteReadError if the stream ends first."""
        for view in views:
            done, size = 0, len(view)
            while done < size:
                await self._fill()
                n = min(size - done, len(self._chunk) - self._pos)
                # Through a memoryview: slicing the bytes chunk itself would copy it first, a
                # second memcpy of every payload byte on the put path.
                view[done : done + n] = memoryview(self._chunk)[self._pos : self._pos + n]
                done += n
                self._pos += n

    async def skip(self, n: int) -> None:
        while n:
            await self._fill()
            k = min(n, len(self._chunk) - self._pos)
            self._pos += k
            n -= k

    async def readexactly(self, n: int) -> bytes:
        buf = bytearray(n)
        await self.readinto([memoryview(buf)])
        return bytes(buf)

    async def read_header(self, max_header_bytes: int) -> tuple[dict[str, object], int]:
        """The frame's header map and its encoded length (prefix excluded)."""
        header_len = parse_prefix(await self.readexactly(PREFIX_BYTES), max_header_bytes)
        return decode_header(await self.readexactly(header_len)), header_len

    async def at_eof(self) -> bool:
        if self._pos < len(self._chunk):
            return False
        self._chunk = await self._source.readany()
        self._pos = 0
        return not self._chunk
