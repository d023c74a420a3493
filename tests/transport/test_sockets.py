"""transport/sockets.py: buffers sent straight from their own memory, in order, counted in bytes."""

from __future__ import annotations

import asyncio
import socket

import numpy as np

from prefixstore.transport.sockets import duplicate_socket, send_views


async def _receive(sock: socket.socket, n: int) -> bytes:
    loop = asyncio.get_running_loop()
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = await loop.sock_recv_into(sock, view[got:])
        assert k, "the sender closed early"
        got += k
    return bytes(buf)


async def test_typed_and_plain_buffers_arrive_whole_and_in_order() -> None:
    """A 2-D float16 view is 2 bytes an item and its len() counts rows: sent as its bytes, not its
    rows (asyncio's sock_sendall counts what it sent against len()). Larger than the socket takes
    at once, so the sends wait for writability between pieces."""
    rng = np.random.default_rng(3)
    typed = rng.standard_normal((4096, 1024)).astype(np.float16)  # 8 MiB, len() == 4096
    plain = rng.integers(0, 256, 3 << 20, dtype=np.uint8).tobytes()
    a, b = socket.socketpair()
    with a, b:
        a.setblocking(False)
        b.setblocking(False)
        want = plain + typed.tobytes() + plain[:5]
        sender = asyncio.create_task(send_views(a, [plain, memoryview(typed), memoryview(plain)[:5]]))
        got = await asyncio.wait_for(_receive(b, len(want)), 30)
        await asyncio.wait_for(sender, 30)
        assert got == want


async def test_only_plain_stream_transports_have_a_socket_to_send_on() -> None:
    """TLS must go through the transport: no duplicate of an SSL transport's socket."""
    loop = asyncio.get_running_loop()
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        transport, _ = await loop.create_connection(asyncio.Protocol, "127.0.0.1", port)
        try:
            dup = duplicate_socket(transport)
            assert dup is not None and dup.fileno() != transport.get_extra_info("socket").fileno()
            dup.close()
        finally:
            transport.close()

        class TlsLike:  # what an SSL transport says of itself
            def is_closing(self) -> bool:
                return False

            def get_extra_info(self, name: str) -> object:
                return object() if name == "sslcontext" else transport.get_extra_info(name)

        assert duplicate_socket(TlsLike()) is None  # type: ignore[arg-type]
