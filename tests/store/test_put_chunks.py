"""A put is planned a chunk at a time while its body streams in (store/puts.py): the store reserves
the next chunk's pages only once the bytes before it are in, answers per item as a put planned
whole does, and still refuses whole a put that would go over its tenant's quota (tests/security/test_tenants.py).

B = 4 tokens, 256-byte KV blocks (tests/factories.py's namespace).
"""

from __future__ import annotations

import asyncio
import os

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.prompt import with_payload
from prefixstore.protocol.hashing import BlockHash
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.wire import CONTENT_TYPE, ItemSpec, decode_frame, encode_frame
from prefixstore.store.puts import CHUNK_ITEMS, chunks

from ..conftest import RunningStore
from ..factories import make_namespace

NUM_BLOCKS = 3 * CHUNK_ITEMS + 5  # four chunks; each block's parent is the one before (chunk to chunk)


def test_chunks_bound_items_and_bytes() -> None:
    items = [ItemSpec(kind=Kind.BLOCK, hash=BlockHash(bytes(16)), size=s) for s in [1, 1, 1, 10, 10, 1]]
    assert chunks(items, max_items=2, max_bytes=100) == [(0, 2), (2, 4), (4, 6)]
    assert chunks(items, max_items=10, max_bytes=12) == [(0, 3), (3, 4), (4, 6)]
    assert chunks(items[:1], max_items=1, max_bytes=0) == [(0, 1)]  # an item larger than a chunk: alone
    assert chunks([], max_items=4, max_bytes=4) == []


async def _stalled_put(running: RunningStore, tokens: list[int]):  # type: ignore[no-untyped-def]
    """Send a put of NUM_BLOCKS blocks but hold back the payloads after the first chunk's; return the
    pending count once the store waits, and a coroutine that sends the rest and reads the answer."""
    ns = make_namespace()
    c = PrefixClient(ns, ClientConfig(url=running.url, data_path="http"))
    await c.lookup([1, 2, 3], lease=False)  # registers the namespace
    p = c.prompt(tokens)
    specs, payloads = [], []
    for spec, a, b in p.kv_items(len(tokens)):
        data = os.urandom((b - a) * ns.kv.token_bytes)
        specs.append(with_payload(spec, data))
        payloads.append(data)
    head = encode_frame({"ns": ns.id, "items": [s.to_wire() for s in specs]})
    first = b"".join(payloads[:CHUNK_ITEMS])
    rest = b"".join(payloads[CHUNK_ITEMS:])
    host, port = running.url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    writer.write(f"POST /v1/put HTTP/1.1\r\nHost: {host}\r\nContent-Type: {CONTENT_TYPE}\r\n"
                 f"Content-Length: {len(head) + len(first) + len(rest)}\r\n\r\n".encode() + head + first)
    await writer.drain()

    async def finish() -> list[list[object]]:
        writer.write(rest)
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 15)
        assert status.startswith(b"HTTP/1.1 200"), status
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        header, _ = decode_frame(await reader.readexactly(length))
        writer.close()
        await c.close()
        return header["results"]  # type: ignore[return-value]
    return c, finish


async def test_the_next_chunk_is_reserved_only_once_the_bytes_before_it_are_in(running: RunningStore) -> None:
    """Header and the first chunk's payloads sent, the rest held back: the store has reserved the
    first chunk and the second (planned as soon as the first chunk's bytes were in), not all four.
    Sent the rest, every block is stored and readable. Plant: plan the put whole -> all reserved."""
    tokens = list(range(1000, 1000 + 4 * NUM_BLOCKS))
    _, finish = await _stalled_put(running, tokens)
    store = running.store
    for _ in range(500):  # polling for a state, bounded
        if len(store.pending) >= CHUNK_ITEMS:
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.05)  # the store would plan more now if it were going to (it waits for bytes)
    assert CHUNK_ITEMS <= len(store.pending) <= 2 * CHUNK_ITEMS < NUM_BLOCKS
    results = await finish()
    assert [r[0] for r in results] == ["ok"] * NUM_BLOCKS
    assert not store.pending
    store.check()
    async with PrefixClient(make_namespace(), ClientConfig(url=running.url)) as c:
        assert (await c.lookup(tokens, lease=False)).kv_tokens == len(tokens)


