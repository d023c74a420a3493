"""Send a get answer's payloads from the arena's pages straight to the socket.

Why not ``StreamResponse.write``: an asyncio socket transport (CPython 3.11) copies whatever the
socket does not take at once into its own buffer (transport/sockets.py), one more memcpy of most
of a 64 MiB answer (about 7% of the store's CPU in a profile of 1 MiB gets, plus the buffer's
write-ready callbacks), and heap a stalled reader would keep filled. :func:`write_body` sends the
payloads with :func:`transport.sockets.send_views` instead, where that is safe:

* the status line, headers and frame header go through the response as usual; the payloads go
  straight to the socket only where that write left nothing in the transport's buffer (the
  socket took it all: the common case, a fresh answer's first bytes), else every payload goes
  through the response as before;
* aiohttp writes a response only from its handler, which is here awaiting these sends, so
  nothing else writes to the connection meanwhile;
* TLS (or anything but a plain socket): through the response.

A send that fails (the client went away) raises ``OSError``; a cancelled one (the handler's
timeout) leaves the connection mid-body. Either way the caller (store/api.py ``get``) cuts the
connection off: the client sees a truncated body, never a second response inside the first.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiohttp import web

from prefixstore.transport.sockets import duplicate_socket, send_views


async def write_body(request: web.Request, response: web.StreamResponse, views: Iterable[memoryview]) -> int:
    """Write ``views`` as the rest of a started response's body (its header already written).
    Returns the bytes sent past the response (``response.body_length`` counts the others)."""
    transport = request.transport
    sock = duplicate_socket(transport) if transport is not None and not transport.get_write_buffer_size() else None
    if sock is None:
        for view in views:
            await response.write(view)
        return 0
    sent = 0
    with sock:
        for view in views:
            await send_views(sock, (view,))
            sent += view.nbytes
    return sent


__all__ = ["write_body"]
