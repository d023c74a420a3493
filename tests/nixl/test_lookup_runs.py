"""Lookups that place their payloads (store/nixl_lookup.py): reads with one READ, no /v1/nixl/get."""

from __future__ import annotations

import struct
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.device import DeviceBuffer
import prefixstore.client.nixl_path as nixl_path
from prefixstore.client.node import NodeClient
from prefixstore.client.nixl_path import LookupRuns, coalesce, descriptor_lists, hash_chunk_bytes, slice_runs
from prefixstore.protocol.nixl_wire import NixlPlacements
from prefixstore.protocol.wire import WireError
from prefixstore.protocol.wire import GetItem
from prefixstore.store.nixl_target import run_descriptors

from ..factories import kv_payload
from ..waits import wait_until
from .conftest import NEEDS_NIXL, Clock, Start
from .helpers import block_reads, lose_leases_to, namespace, save, tokens

pytestmark = NEEDS_NIXL


def runs(*pairs: int) -> bytes:
    return struct.pack(f"<{len(pairs)}Q", *pairs)


def test_slice_runs_cuts_at_run_boundaries() -> None:
    r = runs(1000, 40, 5000, 24, 9000, 64)  # a 128-byte payload in three runs
    assert slice_runs(r, 0, 128) == r
    assert slice_runs(r, 10, 20) == runs(1010, 20)
    assert slice_runs(r, 30, 40) == runs(1030, 10, 5000, 24, 9000, 6)
    assert slice_runs(r, 64, 64) == runs(9000, 64)
    with pytest.raises(ValueError, match="not inside"):
        slice_runs(r, 100, 29)
    with pytest.raises(ValueError, match="not inside"):
        slice_runs(r, 0, 0)


@settings(max_examples=300, deadline=None)
@given(data=st.data(), page=st.sampled_from([1, 4, 8]), num_pages=st.integers(1, 6))
def test_store_descriptors_cover_exactly_the_bytes_asked_for(data: st.DataObject, page: int, num_pages: int) -> None:
    """run_descriptors (the store's answer for an arena entry) against a byte-by-byte reference:
    the runs, in order, name exactly the arena addresses of bytes [offset, offset + length), and
    no two consecutive runs could have been one."""
    pages = data.draw(st.lists(st.integers(0, 9), min_size=num_pages, max_size=num_pages, unique=True))
    offset = data.draw(st.integers(0, num_pages * page - 1))
    length = data.draw(st.integers(1, num_pages * page - offset))
    base = 1 << 20
    pairs = np.frombuffer(run_descriptors(base, page, pages, offset, length), dtype="<u8").reshape(-1, 2)
    got = [int(a) + k for a, n in pairs.tolist() for k in range(n)]
    assert got == [base + pages[b // page] * page + b % page for b in range(offset, offset + length)]
    assert all(a + n != b for (a, n), (b, _) in zip(pairs.tolist(), pairs.tolist()[1:]))
    assert run_descriptors(base, page, pages, offset, 0) == b""


def test_descriptor_pairs_contiguous_on_both_sides_merge() -> None:
    """Payloads on consecutive arena pages read into consecutive slots become one descriptor; a
    gap on either side, or another device, keeps them apart. The bytes each side covers are kept."""
    # Four 4 KiB payloads: 0-1 consecutive in the arena, 2 elsewhere, 3 right after 2.
    raws = [runs(1 << 20, 4096), runs((1 << 20) + 4096, 4096), runs(9 << 20, 4096), runs((9 << 20) + 4096, 4096)]
    local, remote = descriptor_lists(raws, [4096] * 4, [0x10000, 0x11000, 0x12000, 0x13000])
    l2, r2 = coalesce(local, remote)
    assert l2.tolist() == [[0x10000, 8192, 0], [0x12000, 8192, 0]]
    assert r2.tolist() == [[1 << 20, 8192, 0], [9 << 20, 8192, 0]]
    local, remote = descriptor_lists(raws[:2], [4096] * 2, [0x10000, 0x20000])  # local gap
    assert coalesce(local, remote)[0].tolist() == local.tolist()
    gpu = local.copy()
    gpu[:, 0] = [0x10000, 0x11000]
    gpu[1, 2] = 1  # same addresses, another device
    assert len(coalesce(gpu, remote)[0]) == 2


def test_hashing_overlaps_the_read_only_where_a_thread_can_take_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Chunked READs (hashing chunk k while k+1 transfers) where a core is free and the check
    leaves the loop the GIL: 4+ cores, or 2-3 cores where the check releases the GIL (the native
    loop always, python-xxhash above 64 KiB only); one READ then the hashing otherwise. A chunk
    size set by hand wins."""
    from prefixstore.protocol import checksums

    mib, small = 1 << 20, checksums.GIL_FREE_ABOVE_BYTES
    overlap = nixl_path.OVERLAP_CHUNK_BYTES
    python_xxhash = [(16, [small] * 8, overlap), (16, [mib], overlap), (2, [mib, mib], overlap),
                     (2, [small + 1] * 4, overlap), (2, [mib, small], 0), (3, [small] * 4, 0),
                     (1, [mib], 0), (None, [mib], 0), (8, [], 0)]
    native = [(2, [small] * 8, overlap), (3, [4096, mib], overlap), (1, [small], 0), (2, [], 0)]
    cases = [(None, python_xxhash)] + ([(checksums._native_verify, native)] if checksums._native_verify else [])
    for loop, expected in cases:
        monkeypatch.setattr(checksums, "_native_verify", loop)
        for cores, sizes, want in expected:
            monkeypatch.setattr(nixl_path.os, "cpu_count", lambda c=cores: c)
            assert hash_chunk_bytes(sizes) == want, (loop, cores, sizes)
    monkeypatch.setattr(nixl_path, "HASH_CHUNK_BYTES", 8192)
    assert hash_chunk_bytes([mib]) == 8192


def test_lookup_runs_refuse_malformed_parts_and_expire() -> None:
    cache = LookupRuns(max_entries=2)
    now = time.monotonic()
    k1, k2, k3 = (bytes([1]) + bytes([i]) * 16 for i in (1, 2, 3))
    good = {"agent": "a", "meta_gen": 1, "lease_ttl_s": 30.0,
            "entries": [[k1, 8, 7, runs(4096, 8)], [k2, 8, 7, runs(8192, 8)]]}
    # Malformed parts never reach the cache: the record refuses them (the lookup then fails: a miss).
    for bad, field in (({**good, "entries": [[k1, 8, 7, b"\x00" * 15]]}, "nixl.entries[0].runs"),  # not 16-byte pairs
                       ({**good, "entries": [[b"k1", 8, 7, runs(4096, 8)]]}, "nixl.entries[0].key"),
                       ({**good, "agent": None}, "nixl.agent")):
        with pytest.raises(WireError) as info:
            NixlPlacements.from_wire(bad)
        assert info.value.field == field
    assert cache.add(NixlPlacements.from_wire({**good, "lease_ttl_s": 0.5}), b"L", now) == 0  # no time left to trust it
    assert cache.add(NixlPlacements.from_wire(good), b"L1", now) == 2
    d = cache.get(k1, now)
    assert d is not None and d.deadline == pytest.approx(now + 30.0 - 7.5)  # a quarter of 30 s kept back
    assert cache.get(k1, d.deadline) is None  # past its deadline: gone
    cache.add(NixlPlacements.from_wire({**good, "entries": [[k3, 8, 7, runs(1, 8)]]}), b"L2", now)
    assert len(cache) == 2 and cache.get(k3, now) is not None  # bounded: oldest out
    cache.forget_lease(b"L2")
    assert cache.get(k3, now) is None and cache.get(k2, now) is not None


def record_paths(client: PrefixClient) -> list[str]:
    """The paths of every call the (node) client makes from now on, through its observers seam."""
    paths: list[str] = []
    node = client.impl
    assert isinstance(node, NodeClient)

    async def observe(p: str, header: dict[str, object], answer: dict[str, object]) -> None:
        paths.append(p)

    node.observers.append(observe)
    return paths


async def test_reads_after_a_nixl_lookup_need_no_get_call(start: Start) -> None:
    """Whole blocks of a looked-up prefix come in one READ a batch, straight from the lookup's runs,
    checked by the xxh3 the lookup gave. A layer range has no xxh3 of its own: with checksums on
    it is read the usual way (the store hashes the range), and only a client that turned checks
    off reads it, or any unhashable buffer, from the runs (proven by the lease's deadline)."""
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(41, 6)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="nixl", verify_checksums=False)) as trusting:
        assert await save(client, toks) == 6  # also loads the store's agent: later lookups ask for runs
        paths = record_paths(client)
        looked = await client.lookup(toks)
        assert looked.kv_tokens == len(toks) and len(client.impl.data.placements) == 6
        items, expected = block_reads(client, toks)
        outs = [np.zeros(ns.block_bytes, dtype=np.uint8) for _ in items]
        assert await client.read(items, outs) == [ns.block_bytes] * 6
        assert [o.tobytes() for o in outs] == expected
        assert paths == ["/v1/lookup"]  # no /v1/nixl/get, no release yet
        layer_items, layer_expected = block_reads(client, toks, layer=1)
        louts = [np.zeros(len(e), dtype=np.uint8) for e in layer_expected]
        assert await client.read(layer_items, louts) == [len(e) for e in layer_expected]
        assert [o.tobytes() for o in louts] == layer_expected
        assert paths[1:] == ["/v1/nixl/get", "/v1/release"]  # the range: checked by the store's hash
        assert client.path_bytes["http"] == 0
        assert await client.release(looked.lease_id)
        assert len(client.impl.data.placements) == 0
        assert await client.read(items[:1], outs[:1]) == [ns.block_bytes]
        assert paths[-2:] == ["/v1/nixl/get", "/v1/release"]  # after the release: the usual way

        assert await trusting.read(items[:1], outs[:1]) == [ns.block_bytes]  # connects its agent
        trusted_paths = record_paths(trusting)
        looked = await trusting.lookup(toks)
        louts = [np.zeros(len(e), dtype=np.uint8) for e in layer_expected]
        assert await trusting.read(layer_items, louts) == [len(e) for e in layer_expected]
        assert [o.tobytes() for o in louts] == layer_expected
        region = np.zeros(6 * ns.block_bytes, dtype=np.uint8)
        dev = [DeviceBuffer(region.ctypes.data + j * ns.block_bytes, ns.block_bytes, memory="DRAM") for j in range(6)]
        assert await trusting.read_device(items, dev) == [ns.block_bytes] * 6
        assert region.tobytes() == b"".join(expected)
        assert trusted_paths == ["/v1/lookup"]
        assert await trusting.release(looked.lease_id)
        store.check()


async def test_every_layer_named_is_the_whole_payload_and_reads_from_the_lookup(start: Start) -> None:
    """A read naming every layer, [0, num_layers), as the vLLM connector's load of all layers does,
    is the whole payload: one READ from the lookup's runs, checked by the payload's own xxh3, with
    no /v1/nixl/get and no release. (It went the /v1/nixl/get road before: two more round trips
    to the store per load, 2.7 of a 7 ms tiny-model load.)"""
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(47, 4)
    layers = ns.kv.num_layers
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        assert await save(client, toks) == 4  # also loads the store's agent: later lookups ask for runs
        paths = record_paths(client)
        looked = await client.lookup(toks)
        whole_items, expected = block_reads(client, toks)
        items = [GetItem(key=i.key, layer_start=0, layer_end=layers) for i in whole_items]
        outs = [np.zeros(ns.block_bytes, dtype=np.uint8) for _ in items]
        assert await client.read(items, outs) == [ns.block_bytes] * 4
        assert [o.tobytes() for o in outs] == expected
        assert paths == ["/v1/lookup"]
        assert client.path_bytes["http"] == 0
        assert await client.release(looked.lease_id)
        store.check()


async def test_bytes_read_on_the_lookup_path_are_counted(start: Start) -> None:
    """The bandwidth panel's series on the path the README advertises: a lookup places 6 blocks, the
    client READs them without a /v1/nixl/get, and out/nixl counts exactly those bytes (it read zero
    here before: only /v1/nixl/get counted)."""
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(43, 6)
    registry = store.metrics.registry

    def out(path: str) -> float:
        return registry.get_sample_value("prefixstore_transfer_bytes_total", {"direction": "out", "path": path}) or 0.0

    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        assert await save(client, toks) == 6  # also connects the store's agent
        before = out("nixl")
        paths = record_paths(client)
        looked = await client.lookup(toks)
        items, expected = block_reads(client, toks)
        outs = [np.zeros(ns.block_bytes, dtype=np.uint8) for _ in items]
        assert await client.read(items, outs) == [ns.block_bytes] * 6
        assert [o.tobytes() for o in outs] == expected
        assert paths == ["/v1/lookup"]
        assert out("nixl") - before == 6 * ns.block_bytes
        assert out("http") == 0
        assert await client.release(looked.lease_id)


async def test_described_payloads_stay_pinned_under_eviction_pressure(start: Start) -> None:
    """The lookup's lease pins every payload it placed, not only the chain's last block: a flood
    of other chains cannot take their pages before the READ."""
    url, store = await start(ram_bytes=64 << 10)  # 16 pages of 4 KiB
    ns = namespace()
    toks = tokens(42, 6)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as flood:
        assert await save(client, toks) == 6
        looked = await client.lookup(toks)
        assert len(client.impl.data.placements) == 6
        for seed in range(43, 49):  # many times the arena's room
            await save(flood, tokens(seed, 6))
        items, expected = block_reads(client, toks)
        paths = record_paths(client)
        outs = [np.zeros(ns.block_bytes, np.uint8) for _ in items]
        assert await client.read(items, outs) == [ns.block_bytes] * 6
        assert [o.tobytes() for o in outs] == expected and paths == []
        await client.release(looked.lease_id)
        store.check()


async def test_a_lease_lost_under_a_described_read_is_caught_by_the_checksum(start: Start) -> None:
    """The store expires the lookup's lease early (its clock jumps) and gives the pages to another
    chain: whole-block reads fail their xxh3, are zeroed, and are asked again the usual way, which
    finds them gone -- misses, never the intruder's bytes."""
    clock = Clock()
    url, store = await start(clock, ram_bytes=32 << 10)  # 8 pages: the intruder reuses them
    ns = namespace()
    toks = tokens(51, 4)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as other:
        assert await save(client, toks) == 4
        await client.lookup(toks)
        assert len(client.impl.data.placements) == 4
        await lose_leases_to(store, clock, other, tokens(52, 8))
        items, _ = block_reads(client, toks)
        outs = [np.full(ns.block_bytes, 0xAB, dtype=np.uint8) for _ in items]
        assert await client.read(items, outs) == [-1] * 4
        assert all(not o.any() for o in outs)
        assert client.failures["checksum"] >= 1
        store.check()


async def test_described_runs_are_not_used_past_the_lease_deadline(start: Start) -> None:
    """With a short lease the client's own deadline passes first: the read goes the usual way."""
    url, _ = await start(lease_ttl_s=1.5)  # trusted for 1.5 - 1.0 = 0.5 s after sending
    ns = namespace()
    toks = tokens(53, 2)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        assert await save(client, toks) == 2
        await client.lookup(toks)
        assert len(client.impl.data.placements) == 2
        items, expected = block_reads(client, toks)
        placements = client.impl.data.placements
        await wait_until(lambda: all(placements.get(it.key, time.monotonic()) is None for it in items),
                         "the described runs' deadline passed")
        paths = record_paths(client)
        outs = [np.zeros(len(e), dtype=np.uint8) for e in expected]
        assert await client.read(items, outs) == [len(e) for e in expected]
        assert [o.tobytes() for o in outs] == expected
        assert paths[0] == "/v1/nixl/get"


async def test_store_without_nixl_lookup_part_and_http_clients_see_the_same_answer(start: Start) -> None:
    url, _ = await start()
    ns = namespace()
    toks = tokens(54, 3)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as nixl, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as http:
        assert await save(nixl, toks) == 3
        a, b = await nixl.lookup(toks), await http.lookup(toks)
        assert (a.kv_tokens, a.matched_blocks) == (b.kv_tokens, b.matched_blocks) == (len(toks), 3)
        assert len(nixl.impl.data.placements) == 3 and len(http.impl.data.placements) == 0
        item = GetItem(key=nixl.prompt(toks).block_key(0))
        out = np.zeros(ns.block_bytes, dtype=np.uint8)
        assert await http.read([item], [out]) == [ns.block_bytes]
        assert out.tobytes() == kv_payload(ns, toks, 0, ns.block_tokens)

