"""Sending large buffers straight from their own memory to a transport's socket.

An asyncio socket transport (CPython 3.11) sends what the socket takes at once and *copies the
rest into its own bytearray*, then sends from that copy as the socket drains. For a get answer's
payloads (the store) or a put's (the client) that is one more memcpy of most of the body, and
heap that a slow peer keeps filled. :func:`send_views` instead writes each buffer with
``loop.sock_sendall``: the kernel copies from the caller's memory and nothing else does, and
the event loop waits for writability between sends, serving everything else meanwhile.

How, without fighting the transport that owns the socket:

* the sends go to a ``dup`` of the socket's descriptor (:func:`duplicate_socket`):
  ``loop.sock_sendall`` refuses a descriptor a transport owns, and both descriptors name the
  same connection (one open file description: one non-blocking flag, one send queue);
* bytes must leave in order, so a caller uses it only while the transport's own buffer is empty
  (``get_write_buffer_size() == 0``) and writes nothing through the transport until the sends are
  done (both callers are the only writer of their connection while they send);
* TLS: the bytes must go through the SSL transport, so :func:`duplicate_socket` answers None
  there (and for anything that is not a plain stream socket) and the caller writes through the
  transport as before.

A send that fails (the peer went away) raises ``OSError`` like a transport write; a cancelled
one leaves the connection mid-body, so the caller aborts the transport (both callers do). Each
duplicate holds one more descriptor while it sends; where none is left (EMFILE) there is no
duplicate and the caller writes through the transport, which needs none.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Iterable


def duplicate_socket(transport: asyncio.BaseTransport) -> socket.socket | None:
    """A non-blocking duplicate of a plain (not TLS) stream transport's socket, or None where the
    bytes must go through the transport. The caller closes it."""
    if transport.is_closing() or transport.get_extra_info("sslcontext") is not None:
        return None
    raw = transport.get_extra_info("socket")
    if raw is None or raw.type != socket.SOCK_STREAM:
        return None
    try:
        fd = os.dup(raw.fileno())
    except OSError:  # out of descriptors (EMFILE): the caller writes through the transport, which needs none
        return None
    sock = socket.socket(raw.family, raw.type, raw.proto, fileno=fd)
    sock.setblocking(False)
    return sock


async def send_views(sock: socket.socket, views: Iterable[bytes | memoryview]) -> None:
    """Send every buffer, in order, from its own memory (see the module docstring)."""
    loop = asyncio.get_running_loop()
    for view in views:
        flat = memoryview(view)
        if flat.ndim != 1 or flat.itemsize != 1:
            flat = flat.cast("B")  # sock_sendall counts bytes sent against len(): a typed view's len is not its bytes
        await loop.sock_sendall(sock, flat)


__all__ = ["duplicate_socket", "send_views"]
