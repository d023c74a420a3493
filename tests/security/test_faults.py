"""Fault injection: process death mid-burst, a full LMDB map, stalled clients, floods, a write storm.

Where a process boundary matters (SIGKILL, resident memory, a flood of
sockets) the store is a real ``prefixstore serve`` subprocess
(tests/serve_process.py); the rest run in-process. All traffic is to
127.0.0.1, bounded in count; every wait has a deadline and none is a timing
assertion.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import socket
import struct
from collections.abc import Callable, Iterator
from pathlib import Path

import aiohttp
import numpy as np
import pytest
import xxhash
from aiohttp import web

from prefixstore.client import ClientConfig, PrefixClient, Prompt
from prefixstore.client.prompt import with_payload
from prefixstore.protocol import Namespace, make_entry_key
from prefixstore.protocol.wire import CONTENT_TYPE, STATUS_OK, GetItem, decode_frame, encode_frame, encode_get_items
from prefixstore.store import STORE, StoreConfig, StoreRunner, create_app
from prefixstore.store.lmdb_tier import LmdbTier, ReadOutcome, StoredRecord

from ..conftest import RunningStore
from ..factories import make_namespace
from ..serve_process import StartServe, http_get, serving

MiB = 1 << 20


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def big_namespace() -> Namespace:
    """16-token blocks of 64 KiB (256 layers x 16 B/token), no state: bulk bytes cheaply."""
    return make_namespace(block_tokens=16, num_layers=256, with_state=False, model="fault-bulk")


def rand_bytes(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS in /proc status")


def stats(url: str) -> dict[str, object]:
    status, body = http_get(url + "/v1/stats")
    assert status == 200
    result: dict[str, object] = json.loads(body)
    return result


async def post_frame(s: aiohttp.ClientSession, path: str, body: bytes) -> tuple[int, dict[str, object], memoryview]:
    async with s.post(path, data=body, headers={"Content-Type": CONTENT_TYPE}) as resp:
        raw = await resp.read()
        if resp.status != 200:
            return resp.status, json.loads(raw), memoryview(b"")
        header, rest = decode_frame(raw)
        return resp.status, header, rest


# ---------------------------------------------------------------- SIGKILL during a write burst


async def test_sigkill_during_write_burst(tmp_path: Path, serve: StartServe) -> None:
    """Concurrent puts while the store is SIGKILLed: after a restart every acknowledged entry is
    intact and byte-identical, and no entry is ever served with wrong bytes."""
    ns = make_namespace(block_tokens=4, num_layers=16, with_state=False, model="fault-burst")  # 1 KiB blocks
    data_dir = tmp_path / "lmdb"
    # durability=sync: every acknowledged commit is in LMDB (write-behind, the default, may lose its
    # last write_behind_s: tests/durability covers that bound).
    args = ["--port", "0", "--data-dir", str(data_dir), "--ram-bytes", "4MiB", "--page-bytes", "4KiB",
            "--disk-bytes", "256MiB", "--durability", "sync"]
    first = serve(*args)
    url = first.url or ""
    attempted: dict[bytes, bytes] = {}  # entry key -> the payload sent
    acked: set[bytes] = set()
    kill_after = 150  # acknowledged puts before the kill; the burst continues past it
    killed = asyncio.Event()

    async def writer(s: aiohttp.ClientSession, w: int) -> None:
        for i in range(10_000):
            if killed.is_set():
                return
            toks = [(w * 1_000_000 + i * 100 + t) for t in range(12)]  # 3 blocks, distinct per put
            p = Prompt(ns, toks)
            specs, payloads = [], []
            for spec, a, b in p.kv_items(12):
                data = rand_bytes(hash((w, i, a)) & 0xFFFFFFFF, (b - a) * ns.kv.token_bytes)
                specs.append(with_payload(spec, data))
                payloads.append(data)
                attempted[make_entry_key(spec.kind, spec.hash)] = data
            try:
                status, header, _ = await post_frame(
                    s, "/v1/put", encode_frame({"ns": ns.id, "items": [x.to_wire() for x in specs]}, payloads))
            except (aiohttp.ClientError, asyncio.TimeoutError):
                return  # the server died under this request: nothing of it is acknowledged
            assert status == 200, header
            results = header["results"]
            assert isinstance(results, list)
            for spec, (st, _reason) in zip(specs, results):
                if st == STATUS_OK:
                    acked.add(make_entry_key(spec.kind, spec.hash))
            if len(acked) >= kill_after and not killed.is_set():
                killed.set()
                first.proc.send_signal(signal.SIGKILL)  # mid-burst: the other writers are in flight

    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(base_url=url, timeout=timeout) as s:
        status, _, _ = await post_frame(s, "/v1/namespaces", encode_frame({"namespace": ns.to_wire()}))
        assert status == 200
        await asyncio.gather(*(writer(s, w) for w in range(6)))
    assert killed.is_set(), "the burst ended before the kill"
    assert first.proc.wait(10) == -signal.SIGKILL
    assert len(acked) >= kill_after

    second = serve(*args)
    url2 = second.url or ""
    found = 0
    async with aiohttp.ClientSession(base_url=url2, timeout=timeout) as s:
        keys = list(attempted)
        for lo in range(0, len(keys), 256):
            batch = keys[lo : lo + 256]
            status, header, rest = await post_frame(
                s, "/v1/get", encode_frame({"ns": ns.id, "items": [[k, 0, None] for k in batch]}))
            assert status == 200, header
            pos = 0
            items = header["items"]
            assert isinstance(items, list)
            for key, (st, size, checksum) in zip(batch, items):
                if key in acked:
                    assert st == STATUS_OK, f"acknowledged entry {key.hex()} lost: {st}"
                if st == STATUS_OK:
                    got = bytes(rest[pos : pos + size])
                    pos += size
                    # Acknowledged or not, anything visible is exactly what was sent.
                    assert got == attempted[key], f"entry {key.hex()} served with wrong bytes"
                    assert checksum == xxhash.xxh3_64_intdigest(got)
                    found += 1
                else:
                    assert st == "missing", st
            assert pos == len(rest)
    st2 = stats(url2)
    entries = st2["entries"]
    assert isinstance(entries, dict)
    # Every entry is on disk (write-through); reads promoted some into RAM as well.
    on_disk = sum(n for k, n in entries.items() if k.endswith("/disk"))
    print(f"\nsigkill burst: {len(attempted)} entries sent, {len(acked)} acknowledged, {found} visible after restart")
    assert on_disk == found  # the stats agree with what is readable; nothing else is there
    assert http_get(url2 + "/healthz")[0] == 200
    assert second.stop() == 0


# ---------------------------------------------------------------- LMDB map full


async def test_lmdb_map_full_grows_the_map(tmp_path: Path) -> None:
    """A write larger than the map grows it (outside the transaction) and lands whole."""
    tier = LmdbTier(tmp_path / "lmdb", disk_bytes=1 * MiB)
    try:
        tier.env.set_mapsize(256 << 10)  # LMDB rounds up to what is in use; far below what follows
        tier._map_size = tier.env.info()["map_size"]
        small = tier._map_size
        payloads = [rand_bytes(i, 256 << 10) for i in range(16)]  # 4 MiB in one transaction
        records = [StoredRecord(key=bytes([1]) + i.to_bytes(16, "big"), namespace_id=b"\x00" * 8, parent=None,
                                start=0, tokens=b"", extra=b"", container=None, boundary=0, size=len(p),
                                checksum=xxhash.xxh3_64_intdigest(p)) for i, p in enumerate(payloads)]
        await tier.write([(r, [memoryview(p)]) for r, p in zip(records, payloads)], ())
        assert tier.env.info()["map_size"] > small
        for r, p in zip(records, payloads):
            out = bytearray(len(p))
            assert await tier.read_into(r.key, r.size, r.checksum, [memoryview(out)]) == ReadOutcome.OK
            assert out == p
    finally:
        tier.close()


async def test_write_storm_on_a_tiny_disk_budget(tmp_path: Path, serve: StartServe) -> None:
    """16x the disk budget written through a 1 MiB-budget store: it evicts, stays within the
    budget, never crashes and keeps answering."""
    ns = big_namespace()
    budget = 1 * MiB
    p = serve("--port", "0", "--data-dir", str(tmp_path / "lmdb"), "--ram-bytes", "512KiB", "--page-bytes", "64KiB",
              "--disk-bytes", str(budget))
    url = p.url or ""
    c = PrefixClient(ns, ClientConfig(url=url, timeout_s=10.0))
    try:
        for i in range(16):  # 16 x 1 MiB sequences (16 blocks each)
            toks = list(range(i * 1000, i * 1000 + 256))
            r = await c.save(c.prompt(toks), 256, lambda a, b, i=i: rand_bytes(i * 1000 + a, (b - a) * ns.kv.token_bytes))
            assert r.dropped == 0, r
            assert http_get(url + "/healthz")[0] == 200
            disk = stats(url)["disk"]
            assert isinstance(disk, dict)
            assert disk["payload_bytes"] <= budget, disk
        last = list(range(15_000, 15_256))
        res = await c.lookup(last, lease=False)
        assert res.kv_tokens > 0  # the newest entries are kept
        assert p.proc.poll() is None
        assert "Traceback" not in p.output
    finally:
        await c.close()
    assert p.stop() == 0


# ---------------------------------------------------------------- slow and stalled clients


async def test_stalled_put_times_out_and_does_not_block_others(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A put that sends half its body and stalls: other clients are served meanwhile, and after
    request_timeout_s it is answered 408 and its reserved pages are released."""
    running: RunningStore = await start_store(StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=4 * MiB,
                                                          page_bytes=4096, disk_bytes=64 * MiB, request_timeout_s=1.0))
    ns = make_namespace()
    c = running.client(ns)
    try:
        await c.lookup([1, 2, 3], lease=False)  # registers the namespace
        free_before = running.store.arena.num_free
        toks = list(range(700, 708))
        p = c.prompt(toks)
        specs, payloads = [], []
        for spec, a, b in p.kv_items(8):
            data = rand_bytes(a, (b - a) * ns.kv.token_bytes)
            specs.append(with_payload(spec, data))
            payloads.append(data)
        body = encode_frame({"ns": ns.id, "items": [s.to_wire() for s in specs]}, payloads)
        host, port = running.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(f"POST /v1/put HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n".encode() + body[: len(body) - 100])
        await writer.drain()
        # The server has read the header and reserved pages for the payloads, and now waits.
        for _ in range(200):
            if running.store.pending:
                break
            await asyncio.sleep(0.01)  # polling for a state, bounded
        assert running.store.pending and running.store.arena.num_free < free_before

        # Another client is served while the stalled put waits.
        other = list(range(900, 910))
        r = await c.save(c.prompt(other), 10, lambda a, b: rand_bytes(a, (b - a) * ns.kv.token_bytes))
        assert r.stored > 0 and r.dropped == 0
        assert (await c.lookup(other, lease=False)).kv_tokens == 10

        status_line = await asyncio.wait_for(reader.readline(), 15)
        assert status_line.startswith(b"HTTP/1.1 408"), status_line
        writer.close()
        assert not running.store.pending
        running.store.check()
        assert (await c.lookup(toks, lease=False)).kv_tokens == 0  # nothing of the stalled put is visible
    finally:
        await c.close()


async def test_stalled_control_request_times_out(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    running: RunningStore = await start_store(StoreConfig(port=0, data_dir="none", ram_bytes=1 * MiB,
                                                          page_bytes=4096, request_timeout_s=0.5))
    host, port = running.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/lookup HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                 f"Content-Length: 1000\r\n\r\n".encode() + b"PSF\x01")
    await writer.drain()
    status_line = await asyncio.wait_for(reader.readline(), 15)
    assert status_line.startswith(b"HTTP/1.1 408"), status_line
    writer.close()
    async with aiohttp.ClientSession() as s, s.get(running.url + "/healthz") as resp:
        assert resp.status == 200


async def _save_blocks(url: str, ns: Namespace, num_blocks: int) -> tuple[Prompt, list[bytes]]:
    """Store ``num_blocks`` blocks of random payloads; returns the prompt and the payloads."""
    async with PrefixClient(ns, ClientConfig(url=url, data_path="http")) as c:
        prompt = c.prompt(list(range(num_blocks * 16)))
        payloads = [rand_bytes(j, ns.block_bytes) for j in range(num_blocks)]
        r = await c.save(prompt, num_blocks * 16, lambda a, b: payloads[a // 16])
        assert r.stored == num_blocks and r.dropped == 0, r
    return prompt, payloads


async def _raw_get(url: str, body: bytes, rcvbuf: int) -> socket.socket:
    """A raw connection that POSTs a get frame and reads nothing yet (``rcvbuf``: its receive buffer)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, (host, int(port)))
    await loop.sock_sendall(sock, f"POST /v1/get HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                                  f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
    return sock


async def _until(cond: Callable[[], bool], what: str) -> None:
    for _ in range(1500):  # polling for a state, bounded (15 s)
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


async def test_stalled_get_reader_is_cut_off_and_unpinned(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A client that asks for 16 MiB and never reads: after request_timeout_s the server drops the
    connection and the entries it pinned for the answer become evictable again. (The request in
    the older ``items`` form, which stores still answer.)"""
    running: RunningStore = await start_store(StoreConfig(port=0, data_dir="none", ram_bytes=32 * MiB,
                                                          page_bytes=64 << 10, request_timeout_s=1.0))
    ns = big_namespace()
    prompt, _ = await _save_blocks(running.url, ns, 256)  # 16 MiB: far more than the socket buffers hold
    body = encode_frame({"ns": ns.id, "items": [[prompt.block_key(j), 0, None] for j in range(256)]})
    sock = await _raw_get(running.url, body, 4096)  # a reader that takes (almost) nothing
    try:
        entries = running.store.index.entries.values()
        await _until(lambda: any(e.pins for e in entries), "the get never pinned its entries")
        await _until(lambda: not any(e.pins for e in entries), "a stalled reader kept its entries pinned")
    finally:
        sock.close()
    running.store.check()
    async with aiohttp.ClientSession() as s, s.get(running.url + "/healthz") as resp:
        assert resp.status == 200


async def test_a_stalled_get_reader_holds_no_copy_of_its_answer(start_store, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A client that asks for 16 MiB and reads nothing costs the store the arena pages it pins,
    not a copy: the payloads leave from the arena straight to the socket (store/sendbody.py), so
    the connection's transport buffer holds at most the answer's header, whatever the answer's
    size. (Written through the transport, each payload the socket did not take at once was
    copied into the transport's buffer, up to 1 MiB a connection: heap an attacker could grow
    with stalled readers.)"""
    running: RunningStore = await start_store(StoreConfig(port=0, data_dir="none", ram_bytes=32 * MiB,
                                                          page_bytes=64 << 10, request_timeout_s=5.0))
    ns = big_namespace()
    prompt, _ = await _save_blocks(running.url, ns, 256)
    body = encode_frame({"ns": ns.id, **encode_get_items([GetItem(key=prompt.block_key(j)) for j in range(256)])})
    server = running.server.runner.server
    assert server is not None
    sock = await _raw_get(running.url, body, 4096)
    try:
        entries = running.store.index.entries.values()
        buffered = []
        for _ in range(300):  # sampled while the answer is stalled (3 s of the 5 s timeout), bounded
            if any(e.pins for e in entries):
                buffered.append(sum(h.transport.get_write_buffer_size() for h in server.connections
                                    if h.transport is not None))
            await asyncio.sleep(0.01)
        assert buffered, "the get never pinned its entries"
        assert max(buffered) <= 64 << 10, f"the transport buffered {max(buffered)} bytes of a stalled answer"
    finally:
        sock.close()


async def _serve_runner(config: StoreConfig) -> tuple[web.AppRunner, str]:
    """The store served as `prefixstore serve` serves it (StoreRunner: the parser log, the limits)."""
    runner = StoreRunner(create_app(config), config)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


async def test_a_reader_that_leaves_mid_answer_is_a_disconnect_not_an_error(tmp_path: Path) -> None:
    """A client that resets its connection partway through a 16 MiB get: the store cuts the answer
    off, drops its pins and keeps serving; nothing counts it as a malformed request or logs an
    error (it was neither)."""
    config = StoreConfig(port=0, data_dir="none", ram_bytes=32 * MiB, page_bytes=64 << 10)
    runner, url = await _serve_runner(config)
    try:
        store = runner.app[STORE]
        ns = big_namespace()
        prompt, payloads = await _save_blocks(url, ns, 256)
        keys = [prompt.block_key(j) for j in range(256)]
        body = encode_frame({"ns": ns.id, **encode_get_items([GetItem(key=k) for k in keys])})
        loop = asyncio.get_running_loop()
        for _ in range(3):
            sock = await _raw_get(url, body, 64 << 10)
            got = await loop.sock_recv(sock, 1 << 20)
            assert got.startswith(b"HTTP/1.1 200"), got[:40]
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close = reset
            sock.close()
        entries = store.index.entries.values()
        await _until(lambda: not any(e.pins for e in entries), "an abandoned answer kept its entries pinned")
        assert store.metrics.registry.get_sample_value("prefixstore_malformed_requests_total") == 0
        async with PrefixClient(ns, ClientConfig(url=url, data_path="http")) as c:  # and it keeps serving
            outs = [bytearray(ns.block_bytes) for _ in keys]
            assert await c.read([GetItem(key=k) for k in keys], outs) == [ns.block_bytes] * 256
            assert [bytes(o) for o in outs] == payloads
        store.check()
    finally:
        await runner.cleanup()


async def test_a_get_goes_through_the_transport_when_no_descriptor_is_left(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Out of file descriptors (EMFILE), the direct send cannot duplicate the socket: the answer goes
    through aiohttp's transport instead, whole and checked, never a 500 spliced into a started 200."""
    config = StoreConfig(port=0, data_dir="none", ram_bytes=32 * MiB, page_bytes=64 << 10)
    runner, url = await _serve_runner(config)
    try:
        ns = big_namespace()
        prompt, payloads = await _save_blocks(url, ns, 64)
        import prefixstore.transport.sockets as sockets

        def no_descriptors(fd: int) -> int:
            raise OSError(errno.EMFILE, "Too many open files")

        monkeypatch.setattr(sockets.os, "dup", no_descriptors)
        async with PrefixClient(ns, ClientConfig(url=url, data_path="http")) as c:
            outs = [bytearray(ns.block_bytes) for _ in payloads]
            got = await c.read([GetItem(key=prompt.block_key(j)) for j in range(64)], outs)
            assert got == [ns.block_bytes] * 64 and c.failures == {}
            assert [bytes(o) for o in outs] == payloads
    finally:
        await runner.cleanup()


def test_request_timeout_must_be_positive() -> None:
    from prefixstore.store.config import ConfigError

    with pytest.raises(ConfigError, match="request_timeout_s"):
        StoreConfig(request_timeout_s=0)


# ---------------------------------------------------------------- connection floods


def test_connection_flood_keeps_healthz_answering(tmp_path: Path, serve: StartServe) -> None:
    """200 connections held open (half idle, half with a partial request) do not stop /healthz."""
    p = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "1MiB", "--page-bytes", "4KiB")
    url = p.url or ""
    host, port = url.removeprefix("http://").split(":")
    socks: list[socket.socket] = []
    try:
        for i in range(200):
            s = socket.create_connection((host, int(port)), timeout=5)
            if i % 2:
                s.sendall(b"POST /v1/lookup HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nPSF")
            socks.append(s)
        for _ in range(5):
            assert http_get(url + "/healthz", timeout_s=5)[0] == 200
    finally:
        for s in socks:
            s.close()
    assert http_get(url + "/healthz", timeout_s=5)[0] == 200
    assert p.proc.poll() is None


async def test_concurrent_request_flood(tmp_path: Path, serve: StartServe) -> None:
    p = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "1MiB", "--page-bytes", "4KiB")
    url = p.url or ""
    connector = aiohttp.TCPConnector(limit=0)  # no client-side cap: 200 simultaneous connections
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=30)) as s:
        async def one() -> int:
            async with s.get(url + "/healthz") as resp:
                await resp.read()
                return resp.status

        assert await asyncio.gather(*(one() for _ in range(200))) == [200] * 200


# ---------------------------------------------------------------- a write storm at 10x capacity


async def test_write_storm_rss_stays_bounded(serve: StartServe) -> None:
    """RAM-only store, 10x its ram_bytes written by concurrent clients: resident memory stays
    under ram_bytes plus a fixed overhead, and /healthz answers throughout."""
    ns = big_namespace()
    ram = 16 * MiB
    p = serve("--port", "0", "--data-dir", "none", "--ram-bytes", str(ram), "--page-bytes", "64KiB")
    url = p.url or ""
    pid = p.proc.pid
    baseline = rss_bytes(pid)  # arena preallocated, nothing stored
    peak = baseline
    done = asyncio.Event()

    async def probe() -> None:
        nonlocal peak
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s:
            while not done.is_set():
                async with s.get(url + "/healthz") as resp:
                    assert resp.status == 200
                peak = max(peak, rss_bytes(pid))
                await asyncio.sleep(0.02)  # sampling interval

    async def writer(w: int) -> None:
        c = PrefixClient(ns, ClientConfig(url=url, timeout_s=10.0))
        try:
            for i in range(40):  # 40 x 1 MiB per writer, 4 writers: 160 MiB = 10x ram
                toks = [w * 10_000_000 + i * 1000 + t for t in range(256)]
                r = await c.save(c.prompt(toks), 256, lambda a, b: os.urandom((b - a) * ns.kv.token_bytes))
                assert r.dropped == 0, r
        finally:
            await c.close()

    prober = asyncio.create_task(probe())
    try:
        await asyncio.gather(*(writer(w) for w in range(4)))
    finally:
        done.set()
        await prober
    peak = max(peak, rss_bytes(pid))
    overhead = peak - ram
    print(f"\nwrite storm: ram_bytes={ram / MiB:.0f} MiB, RSS at start {baseline / MiB:.1f} MiB, "
          f"peak {peak / MiB:.1f} MiB, overhead over ram_bytes {overhead / MiB:.1f} MiB")
    assert peak <= ram + 300 * MiB
    st = stats(url)
    arena = st["arena"]
    assert isinstance(arena, dict) and arena["capacity_bytes"] == ram
    assert http_get(url + "/healthz")[0] == 200
    assert p.stop() == 0


