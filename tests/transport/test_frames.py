"""The frame transport (transport/frames.py, transport/receiver.py): get payloads received straight into caller buffers.

Against a real store (in-process, or a subprocess that is SIGKILLed mid-read)
and against a scripted fake that answers /v1/get with malformed responses.
Whatever the store does, ``PrefixClient.read`` returns sizes or -1 and never
raises; only payloads received whole and verified are reported as read."""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import xxhash

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.transport import frames as transport, receiver as receiving
from prefixstore.protocol import KVLayout, Kind, Namespace, make_entry_key
from prefixstore.protocol.hashing import BlockHash
from prefixstore.protocol.wire import CONTENT_TYPE, GetItem, encode_frame, encode_get_items, encode_header
from prefixstore.store import StoreConfig

from ..conftest import RunningStore
from ..factories import make_namespace
from ..serve_process import ServeProcess, StartServe, serving

# ---------------------------------------------------------------- helpers


def big_namespace(num_layers: int = 16, num_heads: int = 4) -> Namespace:
    """B=16, fp16, head_dim 128: num_layers x num_heads x 8 KiB per block (512 KiB by default)."""
    return Namespace(model=f"bulk-{num_layers}x{num_heads}", block_tokens=16, tenant="bulk",
                     kv=KVLayout(num_layers=num_layers, num_heads=num_heads, head_dim=128, dtype="float16"))


async def store_chain(client: PrefixClient, num_tokens: int, seed: int) -> list[tuple[GetItem, bytes]]:
    """Put a chain of random payloads (full blocks, then a tail if num_tokens is not a multiple of B)."""
    rng = np.random.default_rng(seed)
    prompt = client.prompt(rng.integers(0, 1 << 31, num_tokens, dtype=np.uint32))
    specs = [spec for spec, _, _ in prompt.kv_items(num_tokens)]
    payloads = [rng.integers(0, 256, spec.size, dtype=np.uint8).tobytes() for spec in specs]
    results = await client.put(list(zip(specs, payloads)))
    assert [r.status for r in results] == ["ok"] * len(specs), results
    return [(GetItem(key=make_entry_key(spec.kind, spec.hash)), p) for spec, p in zip(specs, payloads)]


@pytest.fixture
async def big_store(start_store: Callable[[StoreConfig], Awaitable[RunningStore]], tmp_path: Path) -> RunningStore:
    return await start_store(StoreConfig(port=0, data_dir=str(tmp_path / "lmdb"), ram_bytes=64 << 20,
                                         page_bytes=64 << 10, disk_bytes=256 << 20, nixl="off"))


# ---------------------------------------------------------------- a real store


async def test_many_payloads_into_every_kind_of_buffer(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 20 * 16 + 5, seed=1)  # 20 x 512 KiB blocks + a 160 KiB tail
        items = [it for it, _ in stored]
        sizes = [len(p) for _, p in stored]
        kinds: list[Callable[[int], bytearray | memoryview | np.ndarray]] = [
            lambda n: np.zeros(n, dtype=np.uint8),
            lambda n: bytearray(n),
            lambda n: memoryview(bytearray(n)),
            lambda n: np.zeros((n // 256, 128), dtype=np.float16),  # a shaped, typed array
        ]
        outs = [kinds[j % len(kinds)](n) for j, n in enumerate(sizes)]
        assert await c.read(items, outs) == sizes
        for out, (_, payload) in zip(outs, stored):
            assert (out.tobytes() if isinstance(out, np.ndarray) else bytes(out)) == payload
        assert c.failures == {}
        big_store.store.check()


async def test_the_store_answers_a_get_in_the_form_it_was_asked_in(big_store: RunningStore) -> None:
    """A packed request (``keys``/``layers``) gets a packed answer; the older ``items`` list (a client of
    an earlier release) gets the older answer; both carry the same statuses, sizes and bytes, layer
    ranges included."""
    import aiohttp

    from prefixstore.protocol.wire import GetAnswer, decode_frame

    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 3 * 16, seed=4)
    missing = GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(b"\x42" * 16)))
    layer_bytes = len(stored[1][1]) // ns.kv.num_layers
    items = [stored[0][0], missing, GetItem(key=stored[1][0].key, layer_start=2, layer_end=5), stored[2][0]]
    want = [stored[0][1], None, stored[1][1][2 * layer_bytes : 5 * layer_bytes], stored[2][1]]
    async with aiohttp.ClientSession(headers={"Content-Type": CONTENT_TYPE}) as s:
        for packed, request in ((True, encode_get_items(items)), (False, {"items": [it.to_wire() for it in items]})):
            async with s.post(big_store.url + "/v1/get", data=encode_frame({"ns": ns.id, **request})) as resp:
                assert resp.status == 200
                header, body = decode_frame(await resp.read())
            assert ("status" in header) == packed and ("items" in header) != packed
            answer = GetAnswer.from_header(header, len(items))
            assert [st.value for st in answer.statuses] == ["ok", "missing", "ok", "ok"]
            assert answer.sizes == [len(w) if w is not None else 0 for w in want]
            got, at = [], 0
            for size, checksum in zip(answer.sizes, answer.checksums):
                got.append(bytes(body[at : at + size]))
                assert xxhash.xxh3_64_intdigest(got[-1]) == checksum or size == 0
                at += size
            assert at == len(body) and [g for g, w in zip(got, want) if w is not None] == [w for w in want if w]


async def test_put_of_typed_payloads_sent_from_their_own_memory(big_store: RunningStore) -> None:
    """A put's large parts go straight from the caller's buffers to the socket (transport/sockets.py):
    payloads given as 2-D float16 arrays arrive whole, byte for byte (tests/protocol/test_sockets.py
    pins the byte counting itself)."""
    from prefixstore.client.prompt import with_payload

    ns = big_namespace()
    rng = np.random.default_rng(7)
    async with big_store.client(ns, data_path="http") as c:
        prompt = c.prompt(rng.integers(0, 1 << 31, 4 * 16, dtype=np.uint32))
        specs = [spec for spec, _, _ in prompt.kv_items(prompt.num_tokens)]
        arrays = [rng.standard_normal((spec.size // 256, 128)).astype(np.float16) for spec in specs]
        assert all(a.nbytes == spec.size and memoryview(a).itemsize == 2 for a, spec in zip(arrays, specs))
        results = await c.put([(with_payload(spec, a), memoryview(a)) for spec, a in zip(specs, arrays)])
        assert [r.status for r in results] == ["ok"] * len(specs), results
        outs = [bytearray(spec.size) for spec in specs]
        got = await c.read([GetItem(key=make_entry_key(spec.kind, spec.hash)) for spec in specs], outs)
        assert got == [spec.size for spec in specs]
        assert [bytes(o) for o in outs] == [a.tobytes() for a in arrays]
        assert c.failures == {}


async def test_small_payloads_many_per_receive(running: RunningStore) -> None:
    """256-byte blocks: many payloads arrive in one receive and are copied out of the scratch."""
    ns = make_namespace(with_state=False)
    async with running.client(ns) as c:
        stored = await store_chain(c, 300 * ns.block_tokens + 3, seed=2)
        outs = [bytearray(len(p)) for _, p in stored]
        assert await c.read([it for it, _ in stored], outs) == [len(p) for _, p in stored]
        assert [bytes(o) for o in outs] == [p for _, p in stored]
        assert c.failures == {}


async def test_buffers_larger_than_payloads(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 6 * 16 + 9, seed=3)
        outs = [np.full(len(p) + 1000 * (j + 1), 0xAB, dtype=np.uint8) for j, (_, p) in enumerate(stored)]
        assert await c.read([it for it, _ in stored], outs) == [len(p) for _, p in stored]
        for out, (_, p) in zip(outs, stored):
            assert out[: len(p)].tobytes() == p
            assert (out[len(p) :] == 0xAB).all(), "bytes past the payload were written"
        assert c.failures == {}


async def test_missing_key_is_a_miss_and_the_others_succeed(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 5 * 16, seed=4)
        missing = GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(b"\x42" * 16)))
        items = [stored[0][0], missing, *[it for it, _ in stored[1:]]]
        outs = [bytearray(512 << 10) for _ in items]
        got = await c.read(items, outs)
        assert got == [512 << 10, -1, *[512 << 10] * 4]
        assert bytes(outs[0]) == stored[0][1] and bytes(outs[2]) == stored[1][1] and bytes(outs[5]) == stored[4][1]
        assert not any(outs[1]), "a missing item's buffer was written"
        assert c.failures == {}  # a miss is not a failure


async def test_payload_larger_than_its_buffer_is_dropped_and_the_stream_continues(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 4 * 16, seed=5)
        outs = [bytearray(len(p)) for _, p in stored]
        outs[1] = bytearray(100)
        got = await c.read([it for it, _ in stored], outs)
        assert got == [len(stored[0][1]), -1, len(stored[2][1]), len(stored[3][1])]
        assert bytes(outs[2]) == stored[2][1] and bytes(outs[3]) == stored[3][1]
        assert not any(outs[1])
        assert c.failures["read"] == 1
        # The answer was read to its end, so the connection serves the next read.
        again = [bytearray(len(p)) for _, p in stored]
        assert await c.read([it for it, _ in stored], again) == [len(p) for _, p in stored]
        assert c.impl.pool.num_connects == 1


async def test_one_connection_serves_consecutive_reads(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 8 * 16 + 1, seed=6)
        items = [it for it, _ in stored]
        pool = c.impl.pool
        before = pool.idle_requests[0]  # control calls (register, offers) share the pool
        for _ in range(5):
            outs = [bytearray(len(p)) for _, p in stored]
            assert await c.read(items, outs) == [len(p) for _, p in stored]
            assert [bytes(o) for o in outs] == [p for _, p in stored]
        assert pool.num_connects == 1
        assert pool.idle == 1 and pool.idle_requests[0] == before + 5
        # Reads split into several batches (max_get_bytes) also share it.
    async with big_store.client(ns, max_get_bytes=1 << 20, data_path="http") as c:
        outs = [bytearray(len(p)) for _, p in stored]
        assert await c.read(items, outs) == [len(p) for _, p in stored]
        # One connection: the namespace registration, then five batches.
        assert c.impl.pool.num_connects == 1 and c.impl.pool.idle_requests[0] == 1 + 5


async def test_concurrent_reads_use_separate_connections(big_store: RunningStore) -> None:
    ns = big_namespace()
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 6 * 16, seed=7)
        items = [it for it, _ in stored]
        outs = [[bytearray(len(p)) for _, p in stored] for _ in range(4)]
        got = await asyncio.gather(*(c.read(items, o) for o in outs))
        assert got == [[len(p) for _, p in stored]] * 4
        assert all([bytes(x) for x in o] == [p for _, p in stored] for o in outs)
        assert c.impl.pool.num_connects == 4


@pytest.mark.parametrize("kind", ["numpy slices", "memoryview slices"])
async def test_back_to_back_destinations_in_one_region(big_store: RunningStore, kind: str) -> None:
    """Slots carved one after another from one staging region (as gpu_staging does) are received as
    runs; gaps, a missing item and a too-small slot in the middle break runs without losing bytes."""
    ns = big_namespace(num_layers=4, num_heads=1)  # 32 KiB blocks: many per run
    async with big_store.client(ns) as c:
        stored = await store_chain(c, 40 * 16 + 7, seed=11)
        missing = GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(b"\x42" * 16)))
        items = [it for it, _ in stored]
        items.insert(17, missing)
        payloads: list[bytes | None] = [p for _, p in stored]
        payloads.insert(17, None)
        sizes = [len(p) if p is not None else 32 << 10 for p in payloads]
        sizes[25] = 100  # too small for its payload: dropped, and a break in the run
        gaps = {j: 64 if j % 9 == 4 else 0 for j in range(len(items))}
        region = np.full(sum(sizes) + sum(gaps.values()), 0xAB, dtype=np.uint8)
        offsets, at = [], 0
        for j, n in enumerate(sizes):
            offsets.append(at)
            at += n + gaps[j]
        if kind == "numpy slices":
            outs: list[np.ndarray | memoryview] = [region[o : o + n] for o, n in zip(offsets, sizes)]
        else:
            outs = [region.data[o : o + n] for o, n in zip(offsets, sizes)]
        got = await c.read(items, outs)
        expected = [len(p) if p is not None and j != 25 else -1 for j, p in enumerate(payloads)]
        assert got == expected
        for j, p in enumerate(payloads):
            if expected[j] != -1:
                assert p is not None and region[offsets[j] : offsets[j] + len(p)].tobytes() == p, j
            elif j != 25:
                assert (region[offsets[j] : offsets[j] + sizes[j]] == 0xAB).all()
            if gaps[j]:
                end = offsets[j] + sizes[j]
                assert (region[end : end + gaps[j]] == 0xAB).all(), f"the gap after slot {j} was written"
        assert c.failures["read"] == 1  # the too-small slot


async def test_unreachable_store_is_a_miss() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with PrefixClient(big_namespace(), ClientConfig(url=f"http://127.0.0.1:{port}")) as c:
        item = GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(b"\x01" * 16)))
        assert await c.read([item, item], [bytearray(10), bytearray(10)]) == [-1, -1]
        assert c.failures["read"] == 1


async def test_read_only_output_buffers_are_rejected(running: RunningStore) -> None:
    async with running.client(make_namespace()) as c:
        item = GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(b"\x01" * 16)))
        with pytest.raises(ValueError, match="writable"):
            await c.read([item], [b"\0" * 16])


# ---------------------------------------------------------------- a store killed mid-read


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


@pytest.mark.slow
async def test_store_killed_mid_read_gives_misses_not_exceptions(serve: StartServe) -> None:
    proc: ServeProcess = serve("--port", "0", "--data-dir", "none", "--ram-bytes", "160MiB", "--page-bytes", "64KiB")
    assert proc.url is not None
    ns = big_namespace(num_layers=16, num_heads=8)  # 1 MiB blocks
    async with PrefixClient(ns, ClientConfig(url=proc.url, timeout_s=30)) as c:
        stored = await store_chain(c, 128 * 16, seed=8)  # 128 MiB
        items = [it for it, _ in stored]
        region = np.zeros(len(stored) << 20, dtype=np.uint8)
        outs = [region[j << 20 : (j + 1) << 20] for j in range(len(stored))]
        task = asyncio.create_task(c.read(items, outs))
        deadline = time.monotonic() + 20
        while not outs[0][:64].any():  # the first payload is arriving: the read is in flight
            assert not task.done(), "the read finished before the store could be killed"
            assert time.monotonic() < deadline
            await asyncio.sleep(0)
        proc.kill()  # SIGKILL
        started = time.monotonic()
        got = await task  # no exception
        assert time.monotonic() - started < 10
        assert -1 in got, "every payload arrived although the store was killed"
        for j, (n, (_, payload)) in enumerate(zip(got, stored)):
            assert n in (-1, len(payload))
            if n != -1:
                assert outs[j].tobytes() == payload, f"item {j} reported read with other bytes"
        assert c.failures["read"] >= 1
        # The store is gone: later reads are misses too, quickly.
        assert await c.read(items[:2], outs[:2]) == [-1, -1]


# ---------------------------------------------------------------- a store that answers garbage


class Cut(bytes):
    """An answer cut short: it is written, then the connection is closed."""


Answer = Callable[[int, bytes], Awaitable[bytes | None]]
"""(request number on this connection, request body) -> bytes to send back (a :class:`Cut`: then
close); None: close without answering."""


class FakeStore:
    """An HTTP/1.1 server that registers namespaces properly and answers /v1/get as scripted."""

    def __init__(self, ns: Namespace, answer: Answer) -> None:
        self.ns = ns
        self.answer = answer
        self.num_connections = 0
        self.paths: list[str] = []
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[object]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)

    async def close(self) -> None:
        assert self.server is not None
        self.server.close()
        for task in list(self.handlers):  # handlers that stall on purpose
            task.cancel()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.num_connections += 1
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        num_gets = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                path = head.split(b" ", 2)[1].decode()
                m = re.search(rb"content-length:\s*(\d+)", head, re.I)
                body = await reader.readexactly(int(m.group(1)) if m else 0)
                self.paths.append(path)
                if path == "/v1/namespaces":
                    writer.write(http_answer(encode_frame({"ns": self.ns.id})))
                else:
                    num_gets += 1
                    out = await self.answer(num_gets, body)
                    if out is None:
                        break
                    writer.write(out)
                    if isinstance(out, Cut):
                        await writer.drain()
                        break
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            pass
        finally:
            writer.close()
            self.handlers.discard(task)


def http_answer(body: bytes, status: str = "200 OK", extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status}\r\nContent-Type: {CONTENT_TYPE}\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
            ).encode() + body


def get_frame(payloads: list[bytes], checksums: list[int] | None = None) -> bytes:
    sums = checksums or [xxhash.xxh3_64_intdigest(p) for p in payloads]
    return encode_frame({"items": [["ok", len(p), s] for p, s in zip(payloads, sums)]}, payloads)


PAYLOADS = [bytes(range(256)) * 4, b"\x07" * 3000, bytes(range(200))]
ITEMS = [GetItem(key=make_entry_key(Kind.BLOCK, BlockHash(bytes([i]) * 16))) for i in range(3)]


@pytest.fixture
async def fake() -> AsyncIterator[Callable[[Answer], Awaitable[FakeStore]]]:
    servers: list[FakeStore] = []

    async def start(answer: Answer) -> FakeStore:
        s = FakeStore(make_namespace(), answer)
        await s.start()
        servers.append(s)
        return s

    yield start
    for s in servers:
        await s.close()


def fixed(data: bytes) -> Answer:
    async def answer(n: int, body: bytes) -> bytes:
        return data
    return answer


def outs_for(payloads: list[bytes]) -> list[bytearray]:
    return [bytearray(len(p) + 10) for p in payloads]


async def test_fake_store_good_answer_is_read(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    """The fake itself speaks the protocol: a well-formed answer is read (and the connection kept)."""
    s = await fake(fixed(http_answer(get_frame(PAYLOADS))))
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        for _ in range(3):
            outs = outs_for(PAYLOADS)
            assert await c.read(ITEMS, outs) == [len(p) for p in PAYLOADS]
            assert [bytes(o[: len(p)]) for o, p in zip(outs, PAYLOADS)] == PAYLOADS
        assert c.failures == {} and c.impl.pool.num_connects == 1


GARBAGE = {
    "not http": b"garbage\r\n\r\n",
    "bad status line": b"HTTP/1.1 OK\r\nContent-Length: 0\r\n\r\n",
    "no content-length": b"HTTP/1.1 200 OK\r\nContent-Type: x\r\n\r\n" + get_frame(PAYLOADS),
    "chunked": b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n",
    "not a frame": http_answer(b"hello, this is not a prefixstore frame"),
    "bad msgpack": http_answer(encode_header({"items": []})[:8] + b"\xc1" * 20),
    "header not a map": http_answer(b"PSF\x01\x01\x00\x00\x00\x01"),
    "items not a list": http_answer(encode_frame({"items": 5})),
    "too few items": http_answer(get_frame(PAYLOADS[:2])),
    "bad item": http_answer(encode_frame({"items": [["ok", "big", 0]] * 3})),
    "length mismatch": http_answer(get_frame(PAYLOADS) + b"extra"),
    "huge header_len": http_answer(b"PSF\x01\xff\xff\xff\x7f" + b"\0" * 64),
    "head never ends": b"HTTP/1.1 200 OK\r\nX: " + b"a" * (receiving.MAX_HEAD_BYTES + 100),
    "500 with a body": http_answer(b'{"error": "boom"}', status="500 Internal Server Error"),
    "huge error body": b"HTTP/1.1 503 Unavailable\r\nContent-Length: 99999999\r\n\r\nxx",
}


@pytest.mark.parametrize("kind", sorted(GARBAGE))
async def test_garbage_answers_are_misses(fake: Callable[[Answer], Awaitable[FakeStore]], kind: str) -> None:
    s = await fake(fixed(GARBAGE[kind]))
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http", timeout_s=2.0)) as c:
        outs = outs_for(PAYLOADS)
        started = time.monotonic()
        assert await c.read(ITEMS, outs) == [-1, -1, -1]
        assert time.monotonic() - started < 1.5, "a malformed answer was waited on until the timeout"
        assert c.failures["read"] >= 1
        assert not c.impl.pool.idle or kind == "500 with a body", "a connection with a bad answer was kept"


@pytest.mark.parametrize("where", ["inside payload 1", "before answering", "inside the headers",
                                   "inside the frame header"])
async def test_connection_closed_mid_answer(fake: Callable[[Answer], Awaitable[FakeStore]], where: str) -> None:
    """Payloads received whole and verified count; a partially written one is reported -1."""
    whole = http_answer(get_frame(PAYLOADS))
    cut = {"inside payload 1": len(whole) - len(PAYLOADS[2]) - 1500, "before answering": 0,
           "inside the headers": 20, "inside the frame header": len(whole) - sum(map(len, PAYLOADS)) - 5}[where]
    s = await fake(fixed(Cut(whole[:cut])))
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http", timeout_s=1.0)) as c:
        outs = outs_for(PAYLOADS)
        started = time.monotonic()
        got = await c.read(ITEMS, outs)
        assert time.monotonic() - started < 0.8, "the closed connection was waited on until the timeout"
        if where == "inside payload 1":
            assert got == [len(PAYLOADS[0]), -1, -1]
            assert bytes(outs[0][: len(PAYLOADS[0])]) == PAYLOADS[0]
            assert any(outs[1]), "the test meant to cut inside payload 1"
        else:
            assert got == [-1, -1, -1]
        assert c.failures["read"] == 1
        assert not c.impl.pool.idle


async def test_checksum_mismatch_is_a_miss(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    sums = [xxhash.xxh3_64_intdigest(p) for p in PAYLOADS]
    sums[1] ^= 1
    s = await fake(fixed(http_answer(get_frame(PAYLOADS, sums))))
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        got = await c.read(ITEMS, outs_for(PAYLOADS))
        assert got == [len(PAYLOADS[0]), -1, len(PAYLOADS[2])]
        assert c.failures["checksum"] == 1 and c.failures["read"] == 1
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http", verify_checksums=False)) as c:
        assert await c.read(ITEMS, outs_for(PAYLOADS)) == [len(p) for p in PAYLOADS]


async def test_large_payload_checksum_is_verified_across_receives(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    """Payloads above DIRECT_MIN_BYTES go straight into the buffer and are hashed a receive at a time."""
    rng = np.random.default_rng(9)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (3 << 20, 700 << 10, 5)]
    sums = [xxhash.xxh3_64_intdigest(p) for p in payloads]
    bad = list(sums)
    bad[0] ^= 1 << 63

    async def answer(n: int, body: bytes) -> bytes:
        return http_answer(get_frame(payloads, sums if n % 2 else bad))

    s = await fake(answer)
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        outs = outs_for(payloads)
        assert await c.read(ITEMS, outs) == [len(p) for p in payloads]
        assert [bytes(o[: len(p)]) for o, p in zip(outs, payloads)] == payloads
        assert await c.read(ITEMS, outs_for(payloads)) == [-1, len(payloads[1]), len(payloads[2])]
        assert c.failures["checksum"] == 1


async def test_stalled_answer_times_out_as_a_miss(fake: Callable[[Answer], Awaitable[FakeStore]],
                                                  caplog: pytest.LogCaptureFixture) -> None:
    frame = get_frame(PAYLOADS)

    calls = 0

    async def stall(n: int, body: bytes) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(30)  # cancelled when the fake closes
        return http_answer(frame)

    s = await fake(stall)
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http", timeout_s=0.3)) as c:
        started = time.monotonic()
        assert await c.read(ITEMS, outs_for(PAYLOADS)) == [-1, -1, -1]
        assert time.monotonic() - started < 2
        assert c.failures["read"] == 1
        assert "timeout_s=0.3" in caplog.text
        # The timed-out connection is not reused: the next read opens a fresh one and succeeds.
        assert await c.read(ITEMS, outs_for(PAYLOADS)) == [len(p) for p in PAYLOADS]
        assert c.impl.pool.num_connects == 2


async def test_cancelled_read_drops_its_connection(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    frame = get_frame(PAYLOADS)
    started = asyncio.Event()

    async def slow(n: int, body: bytes) -> bytes:
        if not started.is_set():
            started.set()
            await asyncio.sleep(30)
        return http_answer(frame)

    s = await fake(slow)
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        outs = outs_for(PAYLOADS)
        task = asyncio.create_task(c.read(ITEMS, outs))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not c.impl.pool.idle
        assert await c.read(ITEMS, outs) == [len(p) for p in PAYLOADS]
        assert c.impl.pool.num_connects == 2


async def test_kept_alive_connection_closed_by_the_store_is_retried(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    """The store drops an idle kept-alive connection just as the next request goes out: retried once, fresh."""
    frame = get_frame(PAYLOADS)

    async def one_per_connection(n: int, body: bytes) -> bytes | None:
        return http_answer(frame) if n == 1 else None  # the second request on a connection: closed unanswered

    s = await fake(one_per_connection)
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        for _ in range(3):
            outs = outs_for(PAYLOADS)
            assert await c.read(ITEMS, outs) == [len(p) for p in PAYLOADS]
            assert [bytes(o[: len(p)]) for o, p in zip(outs, PAYLOADS)] == PAYLOADS
        assert c.failures == {}


async def test_store_that_forgot_the_namespace_is_asked_again(fake: Callable[[Answer], Awaitable[FakeStore]]) -> None:
    """A 404 (the store restarted and lost its namespaces): register again and retry the read once."""
    frame = get_frame(PAYLOADS)
    calls = 0

    async def forgetful(n: int, body: bytes) -> bytes:
        nonlocal calls
        calls += 1
        if calls == 1:
            return http_answer(b'{"error": "ns: unknown namespace", "field": "ns"}', status="404 Not Found")
        return http_answer(frame)

    s = await fake(forgetful)
    async with PrefixClient(s.ns, ClientConfig(url=s.url, data_path="http")) as c:
        assert await c.read(ITEMS, outs_for(PAYLOADS)) == [len(p) for p in PAYLOADS]
        assert s.paths == ["/v1/namespaces", "/v1/get", "/v1/namespaces", "/v1/get"]
        assert c.failures == {}
        assert c.impl.pool.num_connects == 1  # the 404 answer was read whole: its connection was kept


def test_parse_head() -> None:
    h = transport.parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\nConnection: keep-alive")
    assert (h.status, h.content_length, h.keep_alive) == (200, 12, True)
    assert not transport.parse_head(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\nConnection: close").keep_alive
    assert not transport.parse_head(b"HTTP/1.0 200 OK\r\nContent-Length: 0").keep_alive
    for bad in (b"HTTP/2 200 OK\r\nContent-Length: 1", b"HTTP/1.1 200 OK\r\nContent-Length: -1",
                b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2", b"HTTP/1.1 200 OK\r\nno colon",
                b"HTTP/1.1 200 OK"):
        with pytest.raises(transport.Malformed):
            transport.parse_head(bad)


def test_pool_url_and_request() -> None:
    pool = transport.FramePool("http://store.local:9000/base/", connect_timeout_s=1.0)
    assert (pool.host, pool.port, pool.base_path) == ("store.local", 9000, "/base")
    head = transport.request_head(pool, "/v1/get", 42)
    assert head.startswith(b"POST /base/v1/get HTTP/1.1\r\nHost: store.local:9000\r\n")
    assert b"Content-Length: 42\r\n" in head and head.endswith(b"\r\n\r\n")
    assert transport.FramePool("http://h", connect_timeout_s=1.0).port == 80
    with pytest.raises(ValueError, match="ssl context"):
        transport.FramePool("https://h", connect_timeout_s=1.0)


# ---------------------------------------------------------------- TLS plumbing


def _self_signed(tmp_path: Path) -> tuple[Path, Path]:
    crypto = pytest.importorskip("cryptography")
    del crypto
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(hours=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


async def test_bulk_read_over_tls(big_store: RunningStore, tmp_path: Path) -> None:
    """The pool hands an ssl context to create_connection; the BufferedProtocol works over TLS too.

    The same store app is served a second time behind TLS; the data is put over plain HTTP."""
    import ssl

    from aiohttp import web

    cert, key = _self_signed(tmp_path)
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_ctx.load_cert_chain(cert, key)
    client_ctx = ssl.create_default_context(cafile=str(cert))
    runner = big_store.server.runner
    assert runner is not None
    before = set(runner.addresses)
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=server_ctx)
    await site.start()
    try:
        (port,) = [address[1] for address in runner.addresses if address not in before]
        ns = big_namespace()
        async with big_store.client(ns) as c:
            stored = await store_chain(c, 6 * 16 + 3, seed=10)
            request = encode_header({"ns": ns.id, **encode_get_items([it for it, _ in stored])})
        pool = transport.FramePool(f"https://127.0.0.1:{port}", connect_timeout_s=5.0, ssl_context=client_ctx)
        try:
            for _ in range(2):
                outs = [bytearray(len(p)) for _, p in stored]
                result = await transport.get_into(pool, request, [memoryview(o) for o in outs], timeout_s=10.0, verify=True)
                assert result.error is None and result.problems == []
                assert result.sizes == [len(p) for _, p in stored]
                assert [bytes(o) for o in outs] == [p for _, p in stored]
            assert pool.num_connects == 1
        finally:
            pool.close()
    finally:
        await site.stop()


async def test_many_small_reads_on_one_kept_alive_connection(start_store) -> None:  # type: ignore[no-untyped-def]
    """Regression: the scratch buffer is compacted about once per MiB received; the
    header search must survive that (it once searched past the data and failed
    every 64th 16 KiB read with 'no end of headers')."""
    import numpy as np

    from prefixstore.client import PrefixClient
    from prefixstore.protocol import KVLayout, Namespace
    from prefixstore.protocol.wire import GetItem
    from prefixstore.store import StoreConfig

    running = await start_store(StoreConfig(port=0, data_dir="none", ram_bytes=16 << 20))
    ns = Namespace(model="m", kv=KVLayout(num_layers=2, num_heads=2, head_dim=64, dtype="float32"), block_tokens=16)
    rng = np.random.default_rng(0)
    client = running.client(ns)
    try:
        tokens = rng.integers(0, 1000, 16 * 64).tolist()
        p = client.prompt(tokens)
        data = rng.integers(0, 256, len(tokens) * ns.kv.token_bytes, dtype=np.uint8)
        per_token = ns.kv.token_bytes
        assert (await client.save(p, len(tokens), lambda a, b: data[a * per_token : b * per_token])).stored == 64
        for j in range(64):
            for layer in (0, 1):
                out = bytearray(16384)
                got = await client.read([GetItem(key=p.block_key(j), layer_start=layer, layer_end=layer + 1)], [out])
                assert got == [16384]
        assert not client.failures
    finally:
        await client.close()
