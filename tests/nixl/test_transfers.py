"""Real NIXL transfers between a `prefixstore serve` process and a client agent in this process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from prefixstore.client import ClientConfig, PrefixClient, SyncPrefixClient
from prefixstore.protocol import Kind, make_entry_key
from prefixstore.protocol.wire import GetItem

from ..factories import kv_payload

from ..serve_process import ServeProcess, StartServe, serving
from .conftest import NEEDS_NIXL
from .helpers import BLOCK_TOKENS, block_reads, interleave_after, metric, namespace, read, save, tokens

pytestmark = NEEDS_NIXL


@pytest.fixture
def serve() -> Iterator[StartServe]:
    with serving() as start:
        yield start


def store_args(data_dir: str, port: int = 0, ram: str = "4MiB", page: str = "4KiB") -> list[str]:
    return ["--port", str(port), "--data-dir", data_dir, "--ram-bytes", ram, "--page-bytes", page,
            "--nixl", "on", "--lease-ttl-s", "30"]


def port_of(proc: ServeProcess) -> int:
    assert proc.url is not None
    return int(proc.url.rsplit(":", 1)[1])


async def test_put_and_get_over_nixl_match_http(serve: StartServe, tmp_path: Path) -> None:
    """A store process and this process's agent: WRITE a chain, READ it back (whole blocks and a
    layer range), byte for byte what the HTTP path returns; the store counts NIXL bytes."""
    proc = serve(*store_args(str(tmp_path / "lmdb"), page="1KiB"))  # a block spans 4 pages: several runs
    url = proc.url
    assert url is not None
    ns = namespace()
    toks = tokens(1, 6)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as http:
        assert await save(nixl, toks) == 6
        assert nixl.path_bytes["nixl"] == 6 * ns.block_bytes and nixl.path_bytes["http"] == 0
        assert nixl.data_path == "nixl"
        missing = tokens(2, 1)  # a block never stored: a miss on both paths
        for layer in (None, 1):
            items, expected = block_reads(nixl, toks, layer)
            extra, _ = block_reads(nixl, missing, layer)
            size = len(expected[0])
            got_n, outs_n = await read(nixl, items + extra, size)
            got_h, outs_h = await read(http, items + extra, size)
            assert got_n == got_h == [size] * len(items) + [-1]
            for out_n, out_h, want in zip(outs_n, outs_h, expected):
                assert out_n.tobytes() == out_h.tobytes() == want
        assert nixl.failures == {}
        assert http.data_path == "http" and http.path_bytes["nixl"] == 0
    items, expected = block_reads(http, toks)
    with SyncPrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as blocking:  # the same over its own loop
        region = np.zeros(len(items) * ns.block_bytes, dtype=np.uint8)
        assert blocking.register_buffer(region)
        outs = [region[i * ns.block_bytes : (i + 1) * ns.block_bytes] for i in range(len(items))]
        assert blocking.read(items, outs) == [ns.block_bytes] * len(items)
        assert [o.tobytes() for o in outs] == expected
        assert blocking.data_path == "nixl" and blocking.path_bytes["nixl"] == len(items) * ns.block_bytes
    assert metric(url, "prefixstore_data_path", 'path="nixl"') == 1
    assert metric(url, "prefixstore_transfer_bytes_total", 'direction="in",path="nixl"') == 6 * ns.block_bytes
    assert metric(url, "prefixstore_transfer_bytes_total", 'direction="out",path="nixl"') >= 6 * ns.block_bytes
    assert metric(url, "prefixstore_leases", "") == 0  # every READ's lease was released


async def test_head_ranges_over_nixl_match_http(serve: StartServe, tmp_path: Path) -> None:
    """An engine at TP=2 reads its own heads over NIXL: the store describes each head range as one
    run per layer and component (state: per tensor), the READ lands them back to back, and the
    bytes are the slices of what was saved, equal to the HTTP path's; in RAM (several pages a
    block) and after a restart (LMDB-resident: a head range is promoted, never pinned in the map)."""
    from ..factories import head_slice, make_headed_namespace, state_head_slice, state_payload

    ns = make_headed_namespace(block_tokens=BLOCK_TOKENS)
    data_dir = str(tmp_path / "lmdb")
    port = 0
    toks = tokens(3, 3)[: 2 * BLOCK_TOKENS + 5]  # two blocks and a tail
    for run in ("ram", "disk"):
        proc = serve(*store_args(data_dir, port=port, page="1KiB"))
        port = port_of(proc)
        url = proc.url
        assert url is not None
        async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as nixl, \
                PrefixClient(ns, ClientConfig(url=url, data_path="http")) as http:
            p = nixl.prompt(toks)
            if run == "ram":
                res = await nixl.save(p, len(toks), lambda a, b: kv_payload(ns, toks, a, b),
                                      {len(toks): state_payload(ns, toks, len(toks))})
                assert res.stored == 4, res
            for rank in (0, 1):
                heads = (2 * rank, 2 * rank + 2)
                items, want = [], []
                for spec, a, b in p.kv_items(len(toks)):
                    items.append(GetItem(key=make_entry_key(spec.kind, spec.hash), head_start=heads[0],
                                         head_end=heads[1]))
                    want.append(head_slice(ns, kv_payload(ns, toks, a, b), b - a, heads))
                items.append(GetItem(key=make_entry_key(Kind.STATE, p.prefix_hash(len(toks))),
                                     head_start=heads[0], head_end=heads[1]))
                want.append(state_head_slice(ns, state_payload(ns, toks, len(toks)), heads))
                for client in (nixl, http):
                    outs = [bytearray(len(w)) for w in want]
                    assert await client.read(items, outs) == [len(w) for w in want], (run, client.data_path)
                    assert [bytes(o) for o in outs] == want, (run, client.data_path)
            assert nixl.data_path == "nixl" and nixl.path_bytes["nixl"] > 0 and nixl.path_bytes["http"] == 0
            assert nixl.failures == {} and http.failures == {}
        assert proc.stop() == 0


async def test_pinned_entries_survive_eviction_pressure_during_a_read(serve: StartServe) -> None:
    """Between the descriptors and the READ, another client fills the arena several times over
    (RAM only: eviction deletes). The leased entries are neither evicted nor overwritten."""
    proc = serve(*store_args("none", ram="256KiB"))  # 64 pages
    assert proc.url is not None
    ns = namespace()
    toks = tokens(3, 8)
    async with PrefixClient(ns, ClientConfig(url=proc.url, data_path="nixl")) as reader, \
            PrefixClient(ns, ClientConfig(url=proc.url, data_path="http")) as writer:
        assert await save(reader, toks) == 8
        stored_under_pressure = 0

        async def pressure(path: str, answer: dict[str, object]) -> None:
            nonlocal stored_under_pressure
            for seed in range(10, 30):  # 20 chains x 8 blocks = 160 pages through a 64-page arena
                stored_under_pressure += await save(writer, tokens(seed, 8))

        interleave_after(reader, "/v1/nixl/get", pressure)
        items, expected = block_reads(reader, toks)
        got, outs = await read(reader, items, ns.block_bytes)
        assert stored_under_pressure > 64  # the arena really turned over while the READ was pending
        assert got == [ns.block_bytes] * 8
        assert [o.tobytes() for o in outs] == expected
        assert reader.failures == {}
    assert metric(proc.url, "prefixstore_evictions_total", 'kind="kv",reason="capacity"') > 0


async def test_store_restart_between_lookup_and_read(serve: StartServe, tmp_path: Path) -> None:
    """A restart between lookup and read reloads the new agent and reads what LMDB kept; a restart
    between the descriptors and the READ fails that READ cleanly and HTTP delivers instead."""
    data_dir = str(tmp_path / "lmdb")
    first = serve(*store_args(data_dir))
    port = port_of(first)
    ns = namespace()
    toks = tokens(4, 4)
    async with PrefixClient(ns, ClientConfig(url=first.url or "", data_path="nixl")) as client:
        assert await save(client, toks) == 4
        looked = await client.lookup(toks)
        assert looked.kv_tokens == 4 * BLOCK_TOKENS
        old_agent = client.impl.data.channel.path.remote if client.impl.data.channel else None

        first.stop()
        second = serve(*store_args(data_dir, port=port))
        items, expected = block_reads(client, toks)
        got, outs = await read(client, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 4 and [o.tobytes() for o in outs] == expected
        assert client.data_path == "nixl" and client.impl.data.channel is not None
        assert client.impl.data.channel.path.remote != old_agent  # the new incarnation's agent was loaded
        nixl_bytes = client.path_bytes["nixl"]
        assert nixl_bytes >= 4 * ns.block_bytes

        async def restart(path: str, answer: dict[str, object]) -> None:
            second.stop()  # the descriptors now point into a dead process's arena
            serve(*store_args(data_dir, port=port))

        interleave_after(client, "/v1/nixl/get", restart)
        got, outs = await read(client, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 4 and [o.tobytes() for o in outs] == expected
        assert client.failures["nixl"] >= 1  # the failed READ was counted ...
        assert client.path_bytes["nixl"] == nixl_bytes  # ... and the bytes came over HTTP
        assert client.path_bytes["http"] >= 4 * ns.block_bytes
