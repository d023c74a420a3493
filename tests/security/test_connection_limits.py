"""Connection floods and slow heads against a real ``prefixstore serve`` (store/runner.py).

* ``max_connections``: connections beyond the cap are answered one 503 naming
  the knob and closed; the connections already open keep working, and a
  slot freed by a closing client is usable again.
* ``header_timeout_s``: a client that dribbles its request head (slowloris)
  is disconnected; an idle keep-alive connection too; a well-behaved client
  on another connection is served throughout.
"""

from __future__ import annotations

import asyncio
import gc
import json
import re
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from prefixstore.store import StoreConfig, StoreRunner, create_app

from ..serve_process import StartServe, http_get, serving
from .helpers import make_pki


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def _connect(url: str) -> socket.socket:
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    return sock


def _request(sock: socket.socket, path: str = "/healthz") -> tuple[int, bytes]:
    """One keep-alive GET on an open socket; returns (status, body)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: store\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before an answer: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"(?i)content-length:\s*(\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    return int(head.split()[1]), body


def _read_until_closed(sock: socket.socket, deadline_s: float) -> bytes:
    """Everything the server sends until it closes; fails if it is still open at the deadline."""
    sock.settimeout(deadline_s)
    data = b""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk


def _metric(url: str, name: str) -> float:
    status, body = http_get(url + "/metrics")
    assert status == 200
    m = re.search(rf"^{name} (\S+)$", body.decode(), re.MULTILINE)
    assert m, f"{name} not exported"
    return float(m.group(1))


def test_connections_beyond_the_cap_get_a_503_naming_the_knob(serve: StartServe) -> None:
    cap = 4
    proc = serve("--port", "0", "--data-dir", "none", "--max-connections", str(cap), "--header-timeout-s", "30")
    url = proc.url
    assert url is not None
    held = [_connect(url) for _ in range(cap)]
    try:
        # Every held connection is served (keep-alive: the slot stays theirs).
        for sock in held:
            assert _request(sock)[0] == 200
        extra = _connect(url)
        answer = _read_until_closed(extra, deadline_s=10)
        extra.close()
        assert answer.startswith(b"HTTP/1.1 503"), answer[:80]
        body = json.loads(answer.partition(b"\r\n\r\n")[2])
        assert body["field"] == "max_connections" and "max_connections=4" in body["error"]
        # The held connections still work after the refusal.
        assert all(_request(sock)[0] == 200 for sock in held)
        # Free one slot: a new connection is served again.
        held.pop().close()
        for _ in range(100):  # the server sees the close asynchronously
            fresh = _connect(url)
            try:
                status, _ = _request(fresh)
            except ConnectionError:
                status = 0
            if status == 200:
                held.append(fresh)
                break
            fresh.close()
            time.sleep(0.05)
        else:
            pytest.fail("a freed connection slot was never reusable")
        # Metrics come over a held connection (a new one would be refused).
        status, body = _request(held[0], "/metrics")
        assert status == 200
        text = body.decode()
        refused = float(re.search(r"^prefixstore_connections_refused_total (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
        open_now = float(re.search(r"^prefixstore_connections (\S+)$", text, re.M).group(1))  # type: ignore[union-attr]
        assert refused >= 1
        assert open_now == cap
    finally:
        for sock in held:
            sock.close()


def test_a_dribbled_request_head_is_cut_off_and_others_are_served(serve: StartServe) -> None:
    proc = serve("--port", "0", "--data-dir", "none", "--header-timeout-s", "1")
    url = proc.url
    assert url is not None
    slow = _connect(url)
    head = b"POST /v1/lookup HTTP/1.1\r\nHost: store\r\n" + b"".join(
        f"X-Pad-{i}: {'a' * 8}\r\n".encode() for i in range(200))
    closed_after = None
    served_meanwhile = 0
    slow.settimeout(0.2)
    for i in range(0, len(head), 16):  # 16 bytes every 0.2 s: the head would take ~60 s
        try:
            slow.sendall(head[i:i + 16])
            if slow.recv(1) == b"":
                closed_after = i
                break
        except TimeoutError:
            pass
        except (BrokenPipeError, ConnectionResetError):
            closed_after = i
            break
        if http_get(url + "/healthz", timeout_s=5)[0] == 200:
            served_meanwhile += 1
    slow.close()
    assert closed_after is not None, "the server waited for the whole dribbled head"
    assert closed_after < len(head) // 4
    assert served_meanwhile >= 1


def test_an_idle_keep_alive_connection_is_closed(serve: StartServe) -> None:
    proc = serve("--port", "0", "--data-dir", "none", "--header-timeout-s", "1")
    url = proc.url
    assert url is not None
    sock = _connect(url)
    try:
        assert _request(sock)[0] == 200
        assert _read_until_closed(sock, deadline_s=15) == b""  # closed by the server, nothing sent
        assert _metric(url, "prefixstore_connections") <= 1  # only the scrape's own connection
    finally:
        sock.close()


async def test_tls_handshakes_in_progress_count_and_free_their_slot(tmp_path: Path) -> None:
    """Connections stuck before their TLS handshake count against the cap; once they go away, so does their slot."""
    pytest.importorskip("cryptography")
    pki = make_pki(tmp_path)
    config = StoreConfig(port=0, data_dir="none", ram_bytes=4 << 20, page_bytes=4096, max_connections=2,
                         tls_cert_file=str(pki.server_cert), tls_key_file=str(pki.server_key))
    runner = StoreRunner(create_app(config), config)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=config.ssl_context())
        await site.start()
        port = runner.addresses[0][1]
        url = f"https://127.0.0.1:{port}/healthz"
        client_ssl = ssl.create_default_context(cafile=str(pki.ca))
        stuck = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # never say ClientHello
        await asyncio.sleep(0.2)  # let the server accept them
        async with aiohttp.ClientSession() as session:
            async with session.get(url, ssl=client_ssl) as resp:
                assert resp.status == 503
                assert (await resp.json())["field"] == "max_connections"
            for sock in stuck:
                sock.close()
            for _ in range(100):
                gc.collect()
                async with aiohttp.ClientSession() as fresh:
                    try:
                        async with fresh.get(url, ssl=client_ssl) as resp:
                            if resp.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                await asyncio.sleep(0.05)
            else:
                pytest.fail("slots of abandoned TLS handshakes were never freed")
    finally:
        await runner.cleanup()
