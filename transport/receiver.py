"""The receiving side of the frame transport (transport/frames.py): an asyncio buffered protocol that
receives a response into a scratch buffer or straight into the caller's buffers.

Why not aiohttp for these: its client copies
each body byte three times (socket -> ``bytes``, a second ``bytes`` in the
llhttp body callback, then into the destination) and takes an event-loop trip
through its ``StreamReader`` per chunk. On loopback that held GETs at 29-56% of
a raw socket transfer of the same bytes (docs/benchmarks.md). Here the socket
is driven by an :class:`asyncio.BufferedProtocol` (:class:`Receiver`) that
tells the transport where each receive goes::

    scratch (1 MiB, per connection)                      caller buffers
    +------------------------------------------------+
    | status line + headers | prefix | msgpack header | --> views[0][:size0]
    +------------------------------------------------+     views[1][:size1] ...

    * status line, headers, frame header: into the scratch, parsed there;
      payload bytes that arrived with them are copied out first;
    * a payload with >= DIRECT_MIN_BYTES (256 KiB) left, counting the
      destinations that follow it back to back in memory (a run, as an
      engine's staging slots are carved): received straight into the
      destinations, the kernel's copy the only one;
    * smaller rests (say 64 KiB payloads in separate buffers): many per
      receive through the scratch, then copied out -- an event-loop
      iteration per receive costs about as much as the memcpy (see Receiver);
    * a payload larger than its buffer: received into the scratch and dropped.

Checksums (xxh3-64) are verified inline, chunk by chunk right after each
receive, while the bytes are still in the CPU cache (xxh3 runs at ~17 GB/s on
hot data here, ~5.5 GB/s on cold). Verifying on a worker thread instead
(xxhash releases the GIL) was measured slower on the 2-core benchmark VM:
63-71% of raw against 81% inline at 1 MiB payloads (docs/benchmarks.md); the
thread competes for the cores and re-reads the payloads from memory. Hashing
per receive also bounds the time the event loop spends on any one payload,
however large.
"""

from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable, Sequence
from typing import Final

SCRATCH_BYTES: Final = 1 << 20
"""Per connection: the status line and headers, bytes that arrive ahead of a destination, and the
bounce buffer for payload ends smaller than DIRECT_MIN_BYTES (see Receiver)."""
DIRECT_MIN_BYTES: Final = 256 << 10
"""A payload (rest) at least this large is received straight into its destination; a smaller one
through the scratch, together with its neighbours, at the cost of one memcpy."""
MAX_HEAD_BYTES: Final = 16 << 10
"""Longest status line + headers accepted; a longer head is a malformed response."""

Sink = memoryview | int
"""Where the next bytes go: a destination view to fill, or a count of bytes to receive and drop."""
Span = tuple[memoryview, int] | None
"""Per sink: a view over the run of back-to-back destinations it belongs to, and its offset there."""
DataCallback = Callable[[int, int, int], None]
"""``(sink index, start, end)``: bytes [start, end) of that sink have arrived."""


# ---------------------------------------------------------------- the receiving protocol


class Malformed(Exception):
    """A response that is not a well-formed HTTP/1.1 answer (raised inside an exchange, reported as a StoreError)."""


class Receiver(asyncio.BufferedProtocol):
    """Receives into a scratch buffer, or, while :meth:`fill` runs, into a list of sinks.

    Outside :meth:`fill`, received bytes are ``scratch[_start:_end]``, and
    reading is paused while the scratch is full (``get_buffer`` must never
    return an empty buffer). Inside it the scratch holds no unread bytes and
    ``get_buffer`` returns either

    * the unfilled rest of the current destination -- extended over the
      following ones when they lie back to back in memory (:func:`spans_of`:
      an engine's staging region carved into consecutive slots) -- when at
      least ``DIRECT_MIN_BYTES`` of it are left: the kernel writes straight
      into the caller's buffers (one copy), or
    * the scratch, when less is left (or the sink is a payload to drop),
      capped at the end of the run of such small sinks: one receive then
      covers several small payloads, which are copied out. Each receive costs
      an event-loop iteration (~10-30 us of Python: select, callbacks); at
      64 KiB per payload in separate buffers that cost matched the extra
      memcpy (~6 GB/s here). The cap keeps the start of a following large
      payload out of the scratch, and a lone small rest (the end of a large
      payload) is received in place.
    """

    def __init__(self, scratch_bytes: int = SCRATCH_BYTES) -> None:
        self._scratch = bytearray(scratch_bytes)
        self._view = memoryview(self._scratch)
        self._start = 0
        self._end = 0
        self._sinks: Sequence[Sink] = ()
        self._sizes: list[int] = []
        self._spans: list[Span] = []
        self._small_run: list[int] = []  # see _small_runs
        self._sink_index = 0
        self._sink_pos = 0
        self._fill_left = 0  # bytes still expected by the sinks, in all
        self._bounced = False  # the last get_buffer returned the scratch
        self._on_data: DataCallback | None = None
        self._filling = False
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._writable: asyncio.Future[None] | None = None  # set while the transport asks us to stop writing
        self.error: BaseException | None = None  # set once the peer closed or the transport failed
        self.transport: asyncio.Transport | None = None
        self.bytes_received = 0  # since the last reset_count(): tells a stale kept-alive connection apart

    # -------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._filling:
            i, pos = self._sink_index, self._sink_pos
            span = self._spans[i]
            if span is not None:
                view, offset = span
                start = offset + pos
                if len(view) - start >= DIRECT_MIN_BYTES:
                    self._bounced = False
                    return view[start:]
            rest = self._sizes[i] - pos
            small = rest + self._small_run[i + 1]  # this rest and the small sinks after it
            if span is not None and small == rest:
                # A lone small rest (the end of a large payload, before another large
                # one): a receive of its own beats copying it out of the scratch.
                self._bounced = False
                return view[start : start + small]
            self._bounced = True
            return self._view[: min(small, len(self._view))]
        if self._end == len(self._scratch):
            self._compact()
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        if self._filling:
            used = self._advance(nbytes, self._view[:nbytes] if self._bounced else None)
            if used != nbytes:  # get_buffer offers no more than the sinks expect
                raise RuntimeError(f"invariant broken: received {nbytes} bytes where the sinks expected {used}")
            if self._fill_left == 0:
                self._stop_filling()
                self._wake()
            return
        self._end += nbytes
        if self._end == len(self._scratch):
            self._compact()
            if self._end == len(self._scratch):
                self._pause()
        self._wake()

    def eof_received(self) -> bool:
        self._closed(ConnectionResetError("the store closed the connection"))
        return False  # let the transport close itself

    def pause_writing(self) -> None:
        if self._writable is None:
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._writable = self._writable, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def drain(self) -> None:
        """Until the transport takes more (its write buffer fell below the low-water mark)."""
        if self.error is not None:
            raise self.error
        if self._writable is not None:
            await self._writable

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed(exc or ConnectionResetError("the connection was closed"))

    # -------------------------------------------- for the request coroutine

    def reset_count(self) -> None:
        self.bytes_received = 0

    @property
    def buffered(self) -> int:
        return self._end - self._start

    async def read_head(self, limit: int) -> bytes:
        """The bytes up to the first blank line (excluded); consumes the blank line too."""
        # Search offsets are kept relative to _start: _wait() may compact the
        # scratch buffer (move the unread bytes to its front) between rounds.
        seen = 0
        while True:
            k = self._scratch.find(b"\r\n\r\n", self._start + max(0, seen - 3), self._end)
            if k >= 0:
                head = bytes(self._view[self._start : k])
                self._start = k + 4
                return head
            if self._end - self._start >= limit:
                raise Malformed(f"no end of headers within {limit} bytes")
            seen = self._end - self._start
            await self._wait()

    async def fill(self, sinks: Sequence[Sink], on_data: DataCallback | None = None) -> None:
        """Fill every sink completely, in order.

        ``on_data(i, start, end)`` runs (on the event loop) whenever bytes
        ``[start, end)`` of sink i have arrived, in order; ``end`` equal to
        the sink's size means it is complete. Bytes already in the scratch are
        copied in first; the rest is received as the class docstring says."""
        self._sinks, self._sink_index, self._sink_pos, self._on_data = sinks, 0, 0, on_data
        self._sizes = [x if isinstance(x, int) else len(x) for x in sinks]
        self._fill_left = sum(self._sizes)
        while self._sink_index < len(sinks) and self._sizes[self._sink_index] == 0:  # leading empty ones
            if on_data is not None:
                on_data(self._sink_index, 0, 0)
            self._sink_index += 1
        self._start += self._advance(self._end - self._start, self._view[self._start : self._end])
        if self._fill_left == 0:
            self._stop_filling()
            return
        # The scratch is drained: from here receives go to the sinks.
        self._start = self._end = 0
        self._spans = spans_of(sinks)
        self._small_run = _small_runs(self._sizes, self._spans)
        if self.error is not None:
            self._stop_filling()
            raise self.error
        self._filling = True
        try:
            while self._filling:
                await self._wait()
        finally:
            # On error or cancellation: drop every reference to the caller's buffers.
            self._stop_filling()

    async def read_exactly(self, n: int) -> bytearray:
        buf = bytearray(n)
        await self.fill([memoryview(buf)])
        return buf

    # -------------------------------------------- internals

    def _advance(self, nbytes: int, src: memoryview | None) -> int:
        """Move ``nbytes`` on through the sinks from the current position, reporting each sink's
        new bytes; copy them from ``src`` (the scratch) unless they were received in place.
        Returns the bytes used (less than ``nbytes`` only when the sinks are full).

        Runs once per payload per receive (1024 times per 64 MiB of 64 KiB
        payloads), so it keeps to locals."""
        sinks, sizes, on_data = self._sinks, self._sizes, self._on_data
        i, pos, used, n = self._sink_index, self._sink_pos, 0, len(sinks)
        while used < nbytes and i < n:
            k = min(sizes[i] - pos, nbytes - used)
            if src is not None:
                sink = sinks[i]
                if not isinstance(sink, int):
                    sink[pos : pos + k] = src[used : used + k]
            if on_data is not None:
                on_data(i, pos, pos + k)
            used += k
            pos += k
            if pos == sizes[i]:
                i, pos = i + 1, 0
                while i < n and sizes[i] == 0:
                    if on_data is not None:
                        on_data(i, 0, 0)
                    i += 1
        self._sink_index, self._sink_pos = i, pos
        self._fill_left -= used
        return used

    def _stop_filling(self) -> None:
        self._filling = False
        self._sinks = ()
        self._sizes = []
        self._spans = []
        self._small_run = []
        self._on_data = None
        self._fill_left = 0

    def _compact(self) -> None:
        if self._start:
            n = self._end - self._start
            self._scratch[:n] = self._scratch[self._start : self._end]
            self._start, self._end = 0, n

    def _pause(self) -> None:
        if not self._paused and self.transport is not None:
            self._paused = True
            self.transport.pause_reading()

    async def _wait(self) -> None:
        """Until the next receive that matters (new scratch bytes, or all sinks filled) or an error."""
        if self.error is not None:
            raise self.error
        if self._paused and self.transport is not None:
            self._compact()
            if self._end < len(self._scratch) or self._filling:
                self._paused = False
                self.transport.resume_reading()
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _closed(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self._stop_filling()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(self.error)
        writable, self._writable = self._writable, None
        if writable is not None and not writable.done():
            writable.set_exception(self.error)


def _size(sink: Sink) -> int:
    return sink if isinstance(sink, int) else len(sink)


def _small_runs(sizes: list[int], spans: list[Span]) -> list[int]:
    """Per sink, plus a 0 at the end: bytes from its start to the end of the run of consecutive
    "small" sinks it begins (0 for a large one). Small: a payload to drop, or one whose run of
    back-to-back destinations has less than DIRECT_MIN_BYTES left from its start -- those that go
    through the scratch. (A large sink's rest becomes small as it fills; the run it then belongs
    to continues with ``out[k + 1]``.)"""
    out = [0] * (len(sizes) + 1)
    following = 0
    for k in range(len(sizes) - 1, -1, -1):
        span = spans[k]
        small = span is None or len(span[0]) - span[1] < DIRECT_MIN_BYTES
        following = sizes[k] + following if small else 0
        out[k] = following
    return out


def spans_of(sinks: Sequence[Sink]) -> list[Span]:
    """For each destination, the run of back-to-back destinations it starts or continues.

    A run is received as one region, so payloads that an engine laid out one
    after another in its staging memory arrive without a receive per payload
    and without the scratch copy. The run's view is built over the raw
    address range (``ctypes``), because the destinations may be separate
    objects (numpy views, memoryview slices) of one allocation. Safe because
    the range is exactly the union of the destinations, each kept alive by
    ``Receiver._sinks`` for as long as the spans are (both are dropped
    together in ``_stop_filling``)."""
    spans: list[Span] = []
    run: list[int] = []  # sink indices of the current run
    run_start = run_end = 0  # its address range

    def close_run() -> None:
        if len(run) == 1:
            sink = sinks[run[0]]
            assert not isinstance(sink, int)
            spans[run[0]] = (sink, 0)
        elif run:
            view = memoryview((ctypes.c_char * (run_end - run_start)).from_address(run_start)).cast("B")
            offset = 0
            for k in run:
                spans[k] = (view, offset)
                offset += _size(sinks[k])
        run.clear()

    for k, sink in enumerate(sinks):
        spans.append(None)
        if isinstance(sink, int) or not len(sink):
            close_run()
            continue
        address = ctypes.addressof(ctypes.c_char.from_buffer(sink))
        if run and address != run_end:
            close_run()
        if not run:
            run_start = address
        run.append(k)
        run_end = address + len(sink)
    close_run()
    return spans


__all__ = ["DIRECT_MIN_BYTES", "MAX_HEAD_BYTES", "SCRATCH_BYTES", "DataCallback", "Malformed", "Receiver", "Sink", "Span", "spans_of"]
