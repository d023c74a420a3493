"""What the process around the store must guard (issue 30, defects 5, 7, 8 and 9), each against a
real ``prefixstore serve``:

5. the connection cap follows the descriptor limit: at a soft RLIMIT_NOFILE far below
   ``max_connections`` a flood gets the cap's 503 before the process runs out of descriptors, and
   the accept errors it may still meet are logged a line at a time, not a traceback each;
7. the admin CLI never follows a redirect (it would carry the admin token to another origin);
8. a request line holding a bearer token never reaches the log, at any level;
9. two stores never share a data directory: the second exits at once naming the holder's PID.
"""

from __future__ import annotations

import http.server
import json
import resource
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from prefixstore.client import ClientConfig, SyncPrefixClient

from ..factories import kv_payload, make_namespace
from ..serve_process import StartServe, clean_env, http_get, run_cli, serving
from .helpers import TOKENS


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def _connect(url: str, timeout_s: float = 2.0) -> socket.socket | None:
    parts = urlsplit(url)
    try:
        return socket.create_connection((parts.hostname, parts.port), timeout=timeout_s)
    except OSError:  # the listen backlog is full: the kernel drops the SYN
        return None


def _answer(sock: socket.socket, wait_s: float) -> bytes:
    """What the server sends on a connection we say nothing on, within ``wait_s`` (b"": nothing yet)."""
    sock.settimeout(wait_s)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionError):
        pass
    return data


# ---------------------------------------------------------------- 5. descriptors


NOFILE = 160


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))  # hard too: the store cannot raise it


def test_a_flood_at_a_low_descriptor_limit_gets_the_caps_503_and_a_quiet_log(serve: StartServe) -> None:
    """Before: the cap stayed max_connections=1024 at a limit of 160 descriptors, no client ever got
    its 503, and every failed accept() logged a traceback (5,413 of them in the issue's run)."""
    proc = serve("--port", "0", "--data-dir", "none", "--header-timeout-s", "30", preexec=_low_nofile)
    url = proc.url
    assert url is not None
    held: list[socket.socket] = []
    refused = 0
    try:
        for _ in range(3 * NOFILE // 2):
            sock = _connect(url)
            if sock is None:
                continue
            held.append(sock)
        for sock in held:
            answer = _answer(sock, 0.05)
            if answer.startswith(b"HTTP/1.1 503"):
                body = json.loads(answer.partition(b"\r\n\r\n")[2])
                assert body["field"] == "max_connections"
                refused += 1
        assert refused >= 1, "no connection was refused with the cap's 503"
    finally:
        for sock in held:
            sock.close()
    # Once the flood is gone the node answers at once (no accept loop starved by log writes).
    deadline = time.monotonic() + 20
    while http_get(url + "/healthz", timeout_s=5)[0] != 200:
        assert time.monotonic() < deadline, "the store did not recover after the flood"
        time.sleep(0.05)
    assert proc.stop() == 0
    out = proc.output
    assert "Traceback" not in out, out[-3000:]
    assert out.count("out of system resource") <= 2, out[-3000:]
    assert "max_connections" in out and f"RLIMIT_NOFILE={NOFILE}" in out  # the lowered cap is logged


def test_a_descriptor_limit_with_no_room_for_connections_fails_at_start(serve: StartServe) -> None:
    def tiny() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, 48))

    proc = serve("--port", "0", "--data-dir", "none", ready=False, preexec=tiny)
    assert proc.proc.wait(30) == 1
    proc.stop()
    assert "RLIMIT_NOFILE" in proc.output and "max_connections" in proc.output


# ---------------------------------------------------------------- 7. admin CLI redirects


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[dict[str, str]] = []
    location = ""

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        type(self).seen.append({k.lower(): v for k, v in self.headers.items()})
        if self.location:
            self.send_response(302)
            self.send_header("Location", self.location + self.path)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = json.dumps({"members": ["http://elsewhere"]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - http.server's name
        pass


def _http_server(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.HTTPServer, str]:
    server = http.server.HTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.mark.parametrize("command", [["stats"], ["namespaces"], ["stats", "--cluster"]])
def test_the_admin_cli_does_not_follow_a_redirect_with_the_admin_token(command: list[str]) -> None:
    other = type("Other", (_Recorder,), {"seen": [], "location": ""})
    redirector = type("Redirector", (_Recorder,), {"seen": [], "location": ""})
    elsewhere, elsewhere_url = _http_server(other)
    redirector.location = elsewhere_url  # another origin: another port
    store, store_url = _http_server(redirector)
    try:
        env = clean_env(PREFIXSTORE_ADMIN_TOKEN="tok-admin-secret-0000")
        done = run_cli([*command[:1], store_url, *command[1:]], env=env)
    finally:
        store.shutdown()
        elsewhere.shutdown()
    assert redirector.seen and redirector.seen[0].get("authorization") == "Bearer tok-admin-secret-0000"
    assert other.seen == [], "the redirect was followed"  # before: followed, token attached
    assert done.returncode == 1
    assert "redirect" in done.stderr and elsewhere_url in done.stderr  # says where it was sent, and that it stopped


# ---------------------------------------------------------------- 8. request lines in the log


def test_a_token_in_the_method_position_never_reaches_the_log(serve: StartServe) -> None:
    """aiohttp logs a first request with a bad method at DEBUG with its traceback, whose message holds
    the raw request line: a client that sent its Authorization header first put its token there."""
    proc = serve("--port", "0", "--data-dir", "none", "--log-level", "DEBUG")
    url = proc.url
    assert url is not None
    token = TOKENS["alpha"]
    for line in (f"Authorization: Bearer {token}\r\n\r\n", f"{token}\x01 / HTTP/1.1\r\nHost: x\r\n\r\n"):
        sock = _connect(url)
        assert sock is not None
        sock.sendall(line.encode())
        assert _answer(sock, 5.0).split(b" ", 2)[1] == b"400"  # aiohttp answers a bad line in HTTP/1.0
        sock.close()
    status, body = http_get(url + "/metrics")
    assert status == 200
    assert "prefixstore_malformed_requests_total 2.0" in body.decode()  # counted, both
    assert proc.stop() == 0
    assert token not in proc.output, [line for line in proc.lines if token in line]
    assert "Error handling request" in proc.output  # a line says it happened (without the bytes)


# ---------------------------------------------------------------- 9. one store per data directory


def test_a_second_store_on_the_same_data_dir_exits_naming_the_holder(serve: StartServe, tmp_path: Path) -> None:
    data = tmp_path / "lmdb"
    first = serve("--port", "0", "--data-dir", str(data))
    url = first.url
    assert url is not None
    ns = make_namespace(block_tokens=4)
    tokens = list(range(1, 17))
    with SyncPrefixClient(ns, ClientConfig(url=url)) as client:
        saved = client.save(client.prompt(tokens), len(tokens), lambda a, b: kv_payload(ns, tokens, a, b))
        assert saved.stored == 4
    second = serve("--port", "0", "--data-dir", str(data), ready=False)
    try:
        rc = second.proc.wait(30)  # before: it opened the same LMDB and served (and flushed) its entries
    except Exception:
        second.kill()
        raise
    second.stop()
    assert rc == 1
    assert f"pid {first.proc.pid}" in second.output and str(data) in second.output, second.output
    with SyncPrefixClient(ns, ClientConfig(url=url)) as client:
        assert client.lookup(tokens).kv_tokens == len(tokens)  # the first one never noticed
    assert first.stop() == 0
    third = serve("--port", "0", "--data-dir", str(data))  # the lock goes with the process
    assert third.url is not None
    with SyncPrefixClient(ns, ClientConfig(url=third.url)) as client:
        assert client.lookup(tokens).kv_tokens == len(tokens)
