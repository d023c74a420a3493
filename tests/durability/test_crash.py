"""kill -9 during a write storm, with real ``prefixstore serve`` processes (docs/operations.md,
"Durability").

``durability=sync``: every acknowledged put is served after the restart, byte for byte.
``durability=write-behind``: what the writer's own counter (``prefixstore_write_behind_written``,
entries written in commit order) said was written before the kill is served, and so is every
put acknowledged longer ago than its bound (``write_behind_s``, with a wide margin); what was
still behind may be missing, and only whole suffixes of a chain (parents are written first).
Neither mode ever serves other bytes than were put, and the store's resident memory stays within
its arena plus a fixed overhead while the writer lags (the entries behind live in arena pages).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Kind, Namespace, make_entry_key
from prefixstore.protocol.wire import GetItem, ItemSpec

from ..serve_process import ServeProcess, StartServe, http_get, serving

BLOCK_TOKENS = 16
BLOCKS_PER_PUT = 32  # x 32 KiB: 1 MiB a put
WRITERS = 4
PUTS_BEFORE_KILL = 24  # acknowledged puts, all writers together; the others' puts are in flight then
RAM_BYTES = 16 << 20  # smaller than what the storm writes: entries are demoted (once written) meanwhile
OVERHEAD_BYTES = 96 << 20  # the interpreter, aiohttp, LMDB, prometheus (idle: ~70 MiB with the arena in), not payloads
BOUND_S = 1.0
MARGIN_S = 3.0


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def namespace() -> Namespace:
    ns = Namespace(model="crash-storm", block_tokens=BLOCK_TOKENS, tenant="default",
                   kv=KVLayout(num_layers=8, num_heads=1, head_dim=64, dtype="float16"))
    assert ns.block_bytes == 32 << 10
    return ns


def args(data_dir: Path, durability: str) -> list[str]:
    return ["--port", "0", "--data-dir", str(data_dir), "--ram-bytes", str(RAM_BYTES), "--page-bytes", "32KiB",
            "--disk-bytes", "1GiB", "--durability", durability, "--write-behind-s", str(BOUND_S),
            "--write-behind-bytes", "4MiB", "--eviction", "lru"]


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


@dataclass
class Put:
    specs: list[ItemSpec]
    payloads: list[bytes]
    acked_s: float = 0.0


@dataclass
class Storm:
    acked: list[Put] = field(default_factory=list)
    rss: list[float] = field(default_factory=list)
    behind: list[float] = field(default_factory=list)
    written: float = 0.0  # the writer's count at the last scrape before the kill


async def storm(p: ServeProcess, ns: Namespace, seed: int) -> tuple[Storm, float]:
    """WRITERS concurrent clients put fresh chains while a scraper samples /metrics; the process
    is killed (SIGKILL) once PUTS_BEFORE_KILL puts are acknowledged. Returns the storm and the
    kill time."""
    assert p.url is not None
    rng = np.random.default_rng(seed)
    out = Storm()
    done = asyncio.Event()

    async def writer(client: PrefixClient) -> None:
        while not done.is_set():
            tokens = rng.integers(0, 1 << 31, BLOCKS_PER_PUT * BLOCK_TOKENS, dtype=np.uint32)
            prompt = client.prompt(tokens)
            specs = [s for s, _, _ in prompt.kv_items(prompt.num_tokens)]
            payloads = [rng.bytes(ns.block_bytes) for _ in specs]
            put = Put(specs, payloads)
            res = await client.put(list(zip(specs, payloads)))
            if done.is_set():
                return  # answered after the kill was decided: not counted as acknowledged
            assert [r.status for r in res] == ["ok"] * len(specs), res[:2]
            put.acked_s = time.monotonic()
            out.acked.append(put)
            if len(out.acked) >= PUTS_BEFORE_KILL:
                done.set()

    async def scraper() -> None:
        while not done.is_set():
            status, body = await asyncio.to_thread(http_get, p.url + "/metrics")
            assert status == 200
            text = body.decode()
            out.rss.append(metric(text, "process_resident_memory_bytes"))
            out.behind.append(metric(text, "prefixstore_write_behind_entries"))
            if not done.is_set():
                out.written = metric(text, "prefixstore_write_behind_written_total")

    clients = [PrefixClient(ns, ClientConfig(url=p.url, timeout_s=30)) for _ in range(WRITERS)]
    try:
        tasks = [asyncio.create_task(writer(c)) for c in clients] + [asyncio.create_task(scraper())]
        waiting = asyncio.create_task(done.wait())
        await asyncio.wait([waiting, *tasks], return_when=asyncio.FIRST_COMPLETED)
        failed = [t for t in tasks if t.done() and t.exception() is not None]
        p.kill()  # SIGKILL, with the other writers' puts (and the scraper) in flight
        killed_s = time.monotonic()
        done.set()
        await asyncio.gather(waiting, *tasks, return_exceptions=True)  # their connections were cut
        if failed:  # a put refused or a scrape that failed before the kill: the storm itself broke
            raise failed[0].exception()  # type: ignore[misc]
    finally:
        for c in clients:
            await c.close()
    return out, killed_s


async def read_back(p: ServeProcess, ns: Namespace, puts: list[Put]) -> list[list[bool]]:
    """Per put, per block: present after the restart. Every present payload is the one put (the
    client verifies checksums too; here the bytes themselves are compared)."""
    assert p.url is not None
    present: list[list[bool]] = []
    async with PrefixClient(ns, ClientConfig(url=p.url, timeout_s=30)) as c:
        for put in puts:
            items = [GetItem(key=make_entry_key(Kind.BLOCK, s.hash)) for s in put.specs]
            outs = [bytearray(ns.block_bytes) for _ in items]
            got = await c.read(items, outs)
            for n, out, want in zip(got, outs, put.payloads):
                assert n in (-1, len(want))
                assert n == -1 or bytes(out) == want, "other bytes than were put"
            present.append([n != -1 for n in got])
    return present


async def test_sync_loses_nothing_acknowledged(tmp_path: Path, serve: StartServe) -> None:
    ns = namespace()
    first = serve(*args(tmp_path / "lmdb", "sync"))
    s, _ = await storm(first, ns, seed=1)
    assert len(s.acked) >= PUTS_BEFORE_KILL
    second = serve(*args(tmp_path / "lmdb", "sync"))
    present = await read_back(second, ns, s.acked)
    lost = sum(not x for blocks in present for x in blocks)
    assert lost == 0, f"{lost} acknowledged entries lost by a sync store"
    assert second.stop() == 0


async def test_write_behind_loses_only_what_was_behind(tmp_path: Path, serve: StartServe) -> None:
    ns = namespace()
    first = serve(*args(tmp_path / "lmdb", "write-behind"))
    status, body = await asyncio.to_thread(http_get, (first.url or "") + "/metrics")
    idle_rss = metric(body.decode(), "process_resident_memory_bytes")
    s, killed_s = await storm(first, ns, seed=2)
    assert len(s.acked) >= PUTS_BEFORE_KILL and s.rss

    # Memory: the arena (resident from start) plus a fixed overhead, however far the writer lagged.
    assert max(s.rss) <= RAM_BYTES + OVERHEAD_BYTES, (max(s.rss), idle_rss, max(s.behind))
    assert max(s.behind) > 0, "the writer never lagged: the storm did not test write-behind"

    second = serve(*args(tmp_path / "lmdb", "write-behind"))
    present = await read_back(second, ns, s.acked)
    # Parents are written before children: a chain keeps a prefix of its blocks, never a hole.
    for blocks in present:
        assert blocks == sorted(blocks, reverse=True), "a chain lost a block but kept one after it"
    # What the writer had counted as written before the kill is there: the acknowledged puts
    # whose entries all precede that count, whichever order the writers' commits took, are those
    # acknowledged before the first put that was still behind, so at least `written` entries of
    # acknowledged puts survive.
    kept = sum(x for blocks in present for x in blocks)
    assert kept >= s.written - BLOCKS_PER_PUT * WRITERS, (kept, s.written)  # in-flight puts' entries count there
    # And the time bound: a put acknowledged longer than write_behind_s (plus a wide margin) before
    # the kill is whole.
    old = [i for i, put in enumerate(s.acked) if put.acked_s < killed_s - BOUND_S - MARGIN_S]
    assert all(all(present[i]) for i in old), [i for i in old if not all(present[i])]
    assert second.stop() == 0
