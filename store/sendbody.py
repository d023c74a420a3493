"""Send a get answer's payloads from the arena's pages straight to the socket.

Why not ``StreamResponse.write``: an asyncio socket transport (CPython 3.11) sends what the
socket takes at once and *copies the rest into its own bytearray*, then sends from that copy as
the socket drains. For a 64 MiB answer on loopback that is one extra memcpy of most of the body
(about 7% of the store's CPU in a profile of 1 MiB gets, plus the buffer's own write-ready
callbacks), and a page of the answer that went into that buffer is no longer where eviction
can see it. :func:`send_views` instead writes each view with ``loop.sock_sendall``: the kernel
copies from the arena page and nothing else does; the event loop waits for writability between
sends and serves every other connection meanwhile.

How, without fighting the transport that owns the socket:

* the status line, headers and frame header go through the response as usual. Bytes must leave
  in order, so the payloads go straight to the socket only where that write left nothing in the
  transport's buffer (the socket took it all: the common case, a fresh answer's first bytes);
  otherwise every payload goes through the response as before (:func:`write_body`);
* the payloads are sent on a ``dup`` of the socket's descriptor: ``loop.sock_sendall`` refuses
  a descriptor a transport owns, and both descriptors name the same connection (one open file
  description: same non-blocking flag, same send queue), so order is kept as long as the
  transport writes nothing meanwhile -- and it does not: aiohttp writes a response only from its
  handler, which is here, awaiting these sends;
* TLS: the bytes must go through the SSL transport; :func:`direct_socket` answers None and the
  payloads go through the response. So does anything that is not a plain socket transport.

A send that fails (the client went away) raises ``ConnectionError`` like a transport write; a
cancelled one (the handler's timeout) leaves the connection mid-body, so the caller aborts the
transport, exactly as it did before.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable

from aiohttp import web


def direct_socket(request: web.Request) -> socket.socket | None:
    """A non-blocking duplicate of the request's plain TCP (or Unix) socket, or None where the
    bytes must go through the transport (TLS, or no socket). The caller closes it."""
    transport = request.transport
    if transport is None or transport.is_closing() or transport.get_extra_info("sslcontext") is not None:
        return None
    raw = transport.get_extra_info("socket")
    if raw is None or raw.type != socket.SOCK_STREAM:
        return None
    sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
    sock.setblocking(False)
    return sock


async def write_body(request: web.Request, response: web.StreamResponse, views: Iterable[memoryview]) -> None:
    """Write ``views`` as the rest of a started response's body (its header already written)."""
    transport = request.transport
    sock = direct_socket(request) if transport is not None and not transport.get_write_buffer_size() else None
    if sock is None:
        for view in views:
            await response.write(view)
        return
    with sock:
        await send_views(sock, views)


async def send_views(sock: socket.socket, views: Iterable[memoryview]) -> None:
    """Send every view, in order, from its own memory (see the module docstring)."""
    loop = asyncio.get_running_loop()
    for view in views:
        await loop.sock_sendall(sock, view)


__all__ = ["direct_socket", "send_views", "write_body"]
