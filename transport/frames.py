"""The frame transport: every call a client makes of a store (and a node of another node), over
pooled HTTP/1.1 keep-alive connections, with get payloads received straight into the caller's
buffers and put payloads sent straight from theirs.

One transport for every caller: the engine's client (client/node.py) for control calls, puts
and gets, and a store node for its replica pushes (store/replication.py). It uses asyncio only,
so both ends of the wire share it (transport/ imports protocol only, and no HTTP library).
Failures are :class:`protocol.errors.StoreError` values that keep the path, the HTTP status and
the field the store named, so callers branch on them, never on text.

How bytes are received (the receiving protocol, its scratch and the inline checksums) is
transport/receiver.py's.

Puts send the frame header and then each payload view as it is (no join into one body). A part of
64 KiB or more goes straight from the caller's memory to a plain socket (transport/sockets.py,
``_send_parts``), the others through the transport under its flow control (``pause_writing`` /
``resume_writing``): either way a body larger than the socket takes waits for it to drain instead
of piling up in the transport's buffer.

Only the bytes of a payload that was received whole and whose checksum
matched are ever reported as read. A connection whose response was not read
to its exact end (any error, timeout or cancellation) is aborted, never
reused, and the transport is closed before the call returns, so nothing is
written into a caller's buffer after that.

TLS: :class:`FramePool` takes an ``ssl_context`` and hands it to
``loop.create_connection``; asyncio's TLS transport drives a
``BufferedProtocol`` the same way (one more copy, out of the TLS layer;
tests/client/test_bulk_read.py reads over TLS).
"""

from __future__ import annotations

import asyncio
import collections
import json
import ssl
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

import xxhash

from prefixstore.protocol.errors import ItemStatus, Problem, StoreError
from prefixstore.protocol.wire import (
    CONTENT_TYPE,
    PREFIX_BYTES,
    GetAnswer,
    Limits,
    WireError,
    decode_frame,
    decode_header,
    encode_header_parts,
    parse_prefix,
)

from .receiver import MAX_HEAD_BYTES, Malformed, Receiver, Sink
from .sockets import duplicate_socket, send_views

MAX_ANSWER_HEADER_BYTES: Final = Limits().max_header_bytes
"""Longest frame header (msgpack) accepted in a get answer (~20 B per item)."""
MAX_ERROR_BODY_BYTES: Final = 16 << 10
"""A non-200 answer's body is read (for the warning) up to this size; past it the connection is dropped."""
MAX_IDLE_CONNECTIONS: Final = 8
"""Kept-alive connections held per pool; concurrent reads beyond this open (and then close) more."""


def _malformed(path: str, message: str) -> StoreError:
    return StoreError(path, f"malformed answer: {message}", problem=Problem.UNAVAILABLE)


def refusal(path: str, status: int, body: bytes) -> StoreError:
    """A non-200 answer as a typed error: the field from the store's JSON body ``{"error", "field"}``."""
    field = ""
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("field"), str):
            field = parsed["field"]
    except ValueError:
        pass
    return StoreError(path, f"answered {status}: {body[:300].decode(errors='replace')}", status=status, field=field)


# ---------------------------------------------------------------- connections and the pool


@dataclass(slots=True)
class Connection:
    """One HTTP/1.1 connection; reusable once a response was read to its exact end."""

    transport: asyncio.Transport
    receiver: Receiver
    num_requests: int = 0
    clean: bool = True  # False from a request's start until its response was read whole

    @property
    def reusable(self) -> bool:
        return (self.clean and self.receiver.error is None and not self.transport.is_closing()
                and self.receiver.buffered == 0)

    def abort(self) -> None:
        self.clean = False
        self.transport.abort()


class FramePool:
    """Kept-alive connections to one store node.

    ``ssl_context``: for an https store, passed as is to ``create_connection``; ``authorization``:
    the Authorization header value sent with every request (a bearer token)."""

    def __init__(self, url: str, *, connect_timeout_s: float, ssl_context: ssl.SSLContext | None = None,
                 max_idle: int = MAX_IDLE_CONNECTIONS, authorization: str | None = None) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url: expected http://host[:port] or https://..., got {url!r}")
        if parts.scheme == "https" and ssl_context is None:
            raise ValueError("url: an https store needs an ssl context")
        self.url = url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.netloc = parts.netloc
        self.base_path = parts.path.rstrip("/")
        self.ssl_context = ssl_context
        if authorization is not None and any(c in authorization for c in "\r\n"):
            raise ValueError("authorization: must not contain line breaks")
        self.authorization = authorization
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self._idle: collections.deque[Connection] = collections.deque()
        self.num_connects = 0
        self.closed = False

    @property
    def idle(self) -> int:
        """Connections kept alive for the next call now."""
        return len(self._idle)

    @property
    def idle_requests(self) -> list[int]:
        """Requests each idle connection has served (a connection's reuse, for tests)."""
        return [c.num_requests for c in self._idle]

    async def connect(self) -> Connection:
        loop = asyncio.get_running_loop()
        try:
            transport, receiver = await asyncio.wait_for(
                loop.create_connection(Receiver, self.host, self.port, ssl=self.ssl_context),
                self.connect_timeout_s)
        except asyncio.TimeoutError as err:
            raise ConnectionRefusedError(f"connect to {self.host}:{self.port} timed out after "
                                         f"{self.connect_timeout_s}s") from err
        assert isinstance(transport, asyncio.Transport)
        self.num_connects += 1
        return Connection(transport, receiver)

    async def acquire(self) -> tuple[Connection, bool]:
        """A connection and whether it served requests before (so may have been closed meanwhile)."""
        while self._idle:
            conn = self._idle.pop()  # the most recently used: least likely to have timed out
            if conn.reusable:
                return conn, True
            conn.abort()
        return await self.connect(), False

    def release(self, conn: Connection) -> None:
        if not self.closed and conn.reusable and len(self._idle) < self.max_idle:
            self._idle.append(conn)
        elif conn.reusable:
            conn.transport.close()
        else:
            conn.abort()

    def close(self) -> None:
        self.closed = True
        while self._idle:
            self._idle.pop().transport.close()


# ---------------------------------------------------------------- one HTTP exchange


@dataclass(frozen=True, kw_only=True, slots=True)
class ResponseHead:
    status: int
    content_length: int
    keep_alive: bool


def parse_head(raw: bytes) -> ResponseHead:
    """Status line and headers of an HTTP/1.x response; a body length is required (no chunking)."""
    try:
        lines = raw.decode("latin-1").split("\r\n")
        version, status_text, *_ = lines[0].split(" ", 2)
        if version not in ("HTTP/1.1", "HTTP/1.0") or len(status_text) != 3 or not status_text.isdigit():
            raise ValueError(lines[0][:80])
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if not sep or not name or name != name.strip():
                raise ValueError(line[:80])
            name, value = name.lower(), value.strip()
            if name in headers and name == "content-length" and headers[name] != value:
                raise ValueError("conflicting Content-Length headers")
            headers[name] = value
    except ValueError as err:
        raise Malformed(f"malformed response head: {err}") from err
    if "transfer-encoding" in headers:
        raise Malformed(f"unexpected Transfer-Encoding {headers['transfer-encoding']!r}")
    length = headers.get("content-length", "")
    if not length.isdigit():
        raise Malformed(f"Content-Length {length!r}")
    connection = headers.get("connection", "").lower()
    keep_alive = "close" not in connection and (version == "HTTP/1.1" or "keep-alive" in connection)
    return ResponseHead(status=int(status_text), content_length=int(length), keep_alive=keep_alive)


def request_head(pool: FramePool, path: str, body_bytes: int, method: str = "POST") -> bytes:
    auth = f"Authorization: {pool.authorization}\r\n" if pool.authorization else ""
    body = f"Content-Type: {CONTENT_TYPE}\r\nContent-Length: {body_bytes}\r\n" if method == "POST" else ""
    return (f"{method} {pool.base_path}{path} HTTP/1.1\r\nHost: {pool.netloc}\r\n{body}"
            f"{auth}Connection: keep-alive\r\n\r\n").encode("latin-1")


def _error_of(path: str, err: BaseException, timeout_s: float) -> StoreError:
    """What a failed exchange is to its caller."""
    if isinstance(err, StoreError):
        return err
    if isinstance(err, asyncio.TimeoutError):
        return StoreError(path, f"no complete answer within timeout_s={timeout_s}", problem=Problem.TIMEOUT)
    if isinstance(err, (Malformed, WireError)):
        return _malformed(path, str(err))
    return StoreError(path, f"{type(err).__name__}: {err}")


# ---------------------------------------------------------------- checksums


class _Verifier:
    """Checks each payload's xxh3-64 as its bytes arrive (see the module docstring for why inline).

    Fed by the receiver's ``on_data``: a payload that arrives in one piece is
    hashed in one call; a larger one through a streaming hasher, a receive at
    a time."""

    def __init__(self, enabled: bool) -> None:
        self._enabled = enabled
        self._expected: dict[int, tuple[int, memoryview, int]] = {}  # sink -> (item, destination, checksum)
        self._partial: dict[int, xxhash.xxh3_64] = {}
        self.ok: list[tuple[int, int]] = []  # (item, payload bytes) received whole and verified
        self.bad: list[int] = []

    def expect(self, sink: int, item: int, view: memoryview, checksum: int) -> None:
        self._expected[sink] = (item, view, checksum)

    def on_data(self, sink: int, start: int, end: int) -> None:
        entry = self._expected.get(sink)
        if entry is None:  # a payload received into scratch and dropped
            return
        item, view, checksum = entry
        if end < len(view):
            if self._enabled:
                hasher = self._partial.get(sink)
                if hasher is None:
                    hasher = self._partial[sink] = xxhash.xxh3_64()
                hasher.update(view[start:end])
            return
        if not self._enabled:
            self.ok.append((item, len(view)))
            return
        hasher = self._partial.pop(sink, None)
        if hasher is None:
            got = xxhash.xxh3_64_intdigest(view)
        else:
            hasher.update(view[start:end])
            got = hasher.intdigest()
        if got == checksum:
            self.ok.append((item, len(view)))
        else:
            self.bad.append(item)


# ---------------------------------------------------------------- POST /v1/get


@dataclass(slots=True)
class GetBatch:
    """What one ``/v1/get`` exchange did.

    ``sizes[j]``: bytes written into ``views[j]`` and verified, or -1 (a miss,
    or a payload that was not received whole and verified). ``problems``:
    (kind, message) for each item that failed on its own ("size": larger than
    its buffer; "checksum": mismatch). ``error``: the failure that ended the
    exchange, if any; ``sizes`` then still holds what was verified before it."""

    sizes: list[int]
    problems: list[tuple[str, str]] = field(default_factory=list)
    error: StoreError | None = None


async def get_into(pool: FramePool, request: bytes, views: Sequence[memoryview], *, timeout_s: float,
                   verify: bool, path: str = "/v1/get") -> GetBatch:
    """POST ``request`` (a whole frame) and receive the payloads into ``views``, one per item.

    Never raises for a store failure (that is ``GetBatch.error``); a
    cancellation propagates, after the connection was aborted."""
    result = GetBatch(sizes=[-1] * len(views))
    verifier = _Verifier(verify)
    try:
        async with asyncio.timeout(timeout_s):
            for attempt in range(2):
                conn, reused = await pool.acquire()
                try:
                    await _exchange(pool, conn, request, views, verifier, result.problems, path)
                except ConnectionError:
                    conn.abort()
                    # A kept-alive connection that the store closed while it sat idle
                    # fails before any byte of the answer: retry once on a fresh one.
                    if attempt or not reused or conn.receiver.bytes_received:
                        raise
                    continue
                except BaseException as err:
                    if isinstance(err, StoreError) and err.status is not None and conn.clean:
                        pool.release(conn)  # an error answer read whole: the connection is fine
                    else:
                        conn.abort()
                    raise
                pool.release(conn)
                break
    except (StoreError, Malformed, WireError, OSError, asyncio.TimeoutError) as err:
        result.error = _error_of(path, err, timeout_s)
        if result.error is not err:
            result.error.__cause__ = err
    for j, size in verifier.ok:
        result.sizes[j] = size
    for j in verifier.bad:
        result.problems.append(("checksum", f"item {j}: payload checksum mismatch after transfer"))
    return result


async def _exchange(pool: FramePool, conn: Connection, request: bytes, views: Sequence[memoryview],
                    verifier: _Verifier, problems: list[tuple[str, str]], path: str) -> None:
    receiver = conn.receiver
    if receiver.error is not None:
        raise ConnectionResetError(str(receiver.error))
    receiver.reset_count()
    conn.clean = False
    conn.num_requests += 1
    conn.transport.write(request_head(pool, path, len(request)) + request)

    head = parse_head(await receiver.read_head(MAX_HEAD_BYTES))
    if head.status != 200:
        if head.content_length > MAX_ERROR_BODY_BYTES:
            raise StoreError(path, f"answered {head.status} (a {head.content_length}-byte body, not read)",
                             status=head.status)
        body = await receiver.read_exactly(head.content_length)
        conn.clean = head.keep_alive  # the answer was read whole: the connection can serve again
        raise refusal(path, head.status, bytes(body))
    if head.content_length < PREFIX_BYTES:
        raise _malformed(path, f"Content-Length {head.content_length} is shorter than a frame")

    header_len = parse_prefix(bytes(await receiver.read_exactly(PREFIX_BYTES)), MAX_ANSWER_HEADER_BYTES)
    header = decode_header(memoryview(await receiver.read_exactly(header_len)))
    answer = GetAnswer.from_header(header, len(views))  # either form (protocol/wire.py)
    ok = ItemStatus.OK
    served = [j for j, st in enumerate(answer.statuses) if st is ok]
    sizes, checksums = answer.sizes, answer.checksums
    body_bytes = PREFIX_BYTES + header_len + sum([sizes[j] for j in served])
    if body_bytes != head.content_length:
        raise _malformed(path, f"the frame holds {body_bytes} bytes, Content-Length says {head.content_length}")

    sinks: list[Sink] = []
    for k, j in enumerate(served):
        size, view = sizes[j], views[j]
        if size > len(view):
            problems.append(("size", f"item {j}: payload of {size} bytes exceeds its {len(view)}-byte buffer"))
            sinks.append(size)  # received into scratch and dropped
        else:
            sink = view[:size]
            sinks.append(sink)
            verifier.expect(k, j, sink, checksums[j])
    await receiver.fill(sinks, verifier.on_data)
    conn.clean = head.keep_alive


# ---------------------------------------------------------------- calls with a small answer


async def post(pool: FramePool, path: str, header: dict[str, object],
               payloads: Sequence[bytes | memoryview] = (), *, timeout_s: float) -> dict[str, object]:
    """POST a frame (``header`` and ``payloads``, each sent from its own buffer) and return the
    answer frame's header, on a pooled connection. Raises :class:`StoreError`.

    Lookups ride this path too: their request is large (a 131k-token prompt is 655 KB) and
    aiohttp's per-request machinery cost about 1.5 ms of a 3.3 ms round trip
    (docs/benchmarks.md); puts send their payloads without joining them into one body."""
    parts = [*encode_header_parts(header), *payloads]
    body_bytes = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
    try:
        body = await _call(pool, request_head(pool, path, body_bytes), parts, path,
                           MAX_ANSWER_HEADER_BYTES + PREFIX_BYTES, timeout_s)
        answer, _ = decode_frame(body, MAX_ANSWER_HEADER_BYTES)
    except (StoreError, Malformed, WireError, OSError, asyncio.TimeoutError) as err:
        raise _error_of(path, err, timeout_s) from err
    return answer


async def get_json(pool: FramePool, path: str, *, timeout_s: float) -> object:
    """GET a small JSON answer (``/v1/members``). Raises :class:`StoreError`."""
    try:
        body = await _call(pool, request_head(pool, path, 0, "GET"), [], path, MAX_ERROR_BODY_BYTES * 64, timeout_s)
        return json.loads(body)
    except ValueError as err:
        raise _malformed(path, f"not JSON ({err})") from err
    except (StoreError, Malformed, OSError, asyncio.TimeoutError) as err:
        raise _error_of(path, err, timeout_s) from err


DIRECT_SEND_BYTES: Final = 64 << 10
"""Parts of a request body at least this large are sent straight from the caller's memory to the
socket (transport/sockets.py) where the connection allows: a put's payloads, a lookup's tokens."""


async def _send_parts(transport: asyncio.Transport, receiver: Receiver, parts: Sequence[bytes | memoryview]) -> None:
    """Write a request body's parts in order: large ones from their own memory where the socket is
    a plain one and the transport holds nothing unsent (else through the transport, whose copy
    waits for it to drain: a body larger than the socket takes waits here, not in memory)."""
    sock = None
    try:
        for part in parts:
            size = part.nbytes if isinstance(part, memoryview) else len(part)
            if size >= DIRECT_SEND_BYTES and not transport.get_write_buffer_size():
                if sock is None:
                    sock = duplicate_socket(transport)
                if sock is not None:
                    await send_views(sock, (part,))
                    continue
            transport.write(part)
            await receiver.drain()
    finally:
        if sock is not None:
            sock.close()


async def _call(pool: FramePool, head: bytes, parts: Sequence[bytes | memoryview], path: str, limit: int,
                timeout_s: float) -> bytes:
    """One request whose answer is read whole (at most ``limit`` bytes); a 200 answer's body."""
    async with asyncio.timeout(timeout_s):
        for attempt in range(2):
            conn, reused = await pool.acquire()
            receiver = conn.receiver
            try:
                if receiver.error is not None:
                    raise ConnectionResetError(str(receiver.error))
                receiver.reset_count()
                conn.clean = False
                conn.num_requests += 1
                conn.transport.write(head)
                await _send_parts(conn.transport, receiver, parts)
                answer = parse_head(await receiver.read_head(MAX_HEAD_BYTES))
                if answer.content_length > (limit if answer.status == 200 else MAX_ERROR_BODY_BYTES):
                    raise StoreError(path, f"answered {answer.status} with a {answer.content_length}-byte body, "
                                     "more than such an answer may have", status=answer.status)
                body = await receiver.read_exactly(answer.content_length)
                conn.clean = answer.keep_alive
            except ConnectionError:
                conn.abort()
                if attempt or not reused or receiver.bytes_received:
                    raise
                continue  # a kept-alive connection the store closed while idle: once more, fresh
            except BaseException:
                conn.abort()
                raise
            pool.release(conn)
            if answer.status != 200:
                raise refusal(path, answer.status, bytes(body))
            return bytes(body)
    raise AssertionError("unreachable")  # pragma: no cover


__all__ = ["MAX_ANSWER_HEADER_BYTES", "FramePool", "GetBatch", "Malformed", "get_into", "get_json", "parse_head", "post", "refusal", "request_head"]
