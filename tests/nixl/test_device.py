"""READs into memory the client cannot hash: ``PrefixClient.read_device`` and GPU staging.

On every machine, host memory wrapped as ``DeviceBuffer(memory="DRAM")`` takes the same path as
GPU memory (no xxh3; the lease proves the bytes). Where CUDA is present, the same checks run
with real GPU memory registered as VRAM and READ into directly (the device run's figures are in
docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import ctypes

import numpy as np
import pytest

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.client.device import DeviceBuffer
from prefixstore.protocol.wire import GetItem

from .conftest import NEEDS_NIXL, Clock, Start
from .helpers import block_reads, interleave_after, lose_leases_to, namespace, save, tokens

pytestmark = NEEDS_NIXL

try:
    import torch

    CUDA = torch.cuda.is_available()
except ImportError:  # pragma: no cover - the test extra installs torch
    CUDA = False

NEEDS_CUDA = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (runs on the GPU machine)")


def host_buffers(n: int, size: int, fill: int = 0xAB) -> tuple[np.ndarray, list[DeviceBuffer]]:
    """One host array cut into n buffers that the client must treat as unhashable."""
    region = np.full(n * size, fill, dtype=np.uint8)
    base = region.ctypes.data
    return region, [DeviceBuffer(base + i * size, size, memory="DRAM") for i in range(n)]


def test_device_buffer_of_reads_the_cuda_array_interface() -> None:
    class Fake:  # what torch and CuPy expose, without either
        __cuda_array_interface__ = {"shape": (4, 256), "typestr": "<f2", "data": (0x7F0000001000, False),
                                    "strides": None, "version": 3}

        class device:  # noqa: N801 - mirrors torch.device
            index = 3

    buf = DeviceBuffer.of(Fake())
    assert (buf.address, buf.nbytes, buf.device, buf.memory) == (0x7F0000001000, 2048, 3, "VRAM")
    assert buf.slice(1024, 512) == DeviceBuffer(0x7F0000001000 + 1024, 512, 3)
    with pytest.raises(ValueError, match="outside"):
        buf.slice(1024, 2048)
    Fake.__cuda_array_interface__ = {**Fake.__cuda_array_interface__, "strides": (2, 8)}  # transposed
    with pytest.raises(ValueError, match="contiguous"):
        DeviceBuffer.of(Fake())
    with pytest.raises(TypeError, match="not a CUDA array"):
        DeviceBuffer.of(np.zeros(4))


async def test_read_device_delivers_the_bytes_and_misses(start: Start) -> None:
    url, _ = await start()
    ns = namespace()
    toks = tokens(21, 4)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", verify_checksums=False)) as client:
        assert await save(client, toks) == 4
        items, expected = block_reads(client, toks)
        missing, _ = block_reads(client, tokens(22, 1))
        # Staging chooses device READs only when asked (device_reads); read_device works regardless.
        assert not client.reads_device
        assert PrefixClient(ns, ClientConfig(url=url, device_reads=True, verify_checksums=False)).reads_device
        region, outs = host_buffers(5, ns.block_bytes)
        before = client.path_bytes["nixl"]  # the save went over NIXL too
        got = await client.read_device(items + missing, outs)
        assert got == [ns.block_bytes] * 4 + [-1]
        assert [region[i * ns.block_bytes : (i + 1) * ns.block_bytes].tobytes() for i in range(4)] == expected
        assert client.path_bytes["nixl"] - before == 4 * ns.block_bytes and client.path_bytes["http"] == 0


def test_unhashable_reads_need_checksums_turned_off() -> None:
    """DESIGN: every payload's xxh3 is checked at every crossing. GPU memory cannot be hashed by
    the client, so READs into it are an operator's explicit choice to trust leases instead."""
    with pytest.raises(ValueError, match="verify_checksums=False"):
        ClientConfig(device_reads=True)
    client = PrefixClient(namespace(), ClientConfig(data_path="nixl"))
    _, outs = host_buffers(1, 64)
    with pytest.raises(ValueError, match="verify_checksums=False"):
        asyncio.run(client.read_device([GetItem(key=b"\x01" * 17)], outs))


async def test_read_device_trusts_only_a_lease_that_held(start: Start) -> None:
    """The lease expires between the descriptors and the READ and another chain takes the pages:
    the READ copies the intruder's bytes, which no checksum can catch here, so the release that
    finds the lease gone makes every item -1."""
    clock = Clock()
    url, store = await start(clock)
    ns = namespace()
    toks = tokens(23, 4)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", verify_checksums=False)) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as other:
        assert await save(client, toks) == 4
        items, _ = block_reads(client, toks)

        async def expire_and_reuse(path: str, answer: dict[str, object]) -> None:
            await lose_leases_to(store, clock, other, tokens(24, 4))

        interleave_after(client, "/v1/nixl/get", expire_and_reuse)
        _, outs = host_buffers(4, ns.block_bytes)
        assert await client.read_device(items, outs) == [-1] * 4
        assert client.failures["read"] >= 1
        store.check()


async def test_read_device_without_nixl_delivers_nothing_and_asks_nothing(start: Start) -> None:
    """The HTTP path cannot write device memory: every item is -1 at once (no request), and
    reads_device says so up front so callers go straight to host reads."""
    url, _ = await start()
    ns = namespace()
    toks = tokens(25, 2)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="http", verify_checksums=False)) as client:
        assert await save(client, toks) == 2
        items, _ = block_reads(client, toks)
        asked: list[str] = []
        interleave_after(client, "/v1/nixl/get", lambda p, a: asked.append(p))  # type: ignore[arg-type,return-value]
        _, outs = host_buffers(2, ns.block_bytes)
        assert not client.reads_device
        assert await client.read_device(items, outs) == [-1, -1]
        assert asked == [] and client.path_bytes["nixl"] == 0
        with pytest.raises(TypeError, match="DeviceBuffer"):
            await client.read_device(items, [bytearray(8), bytearray(8)])  # type: ignore[list-item]


def test_one_transfer_takes_one_memory_type() -> None:
    from prefixstore.client.nixl_path import memory_of

    host = memoryview(bytearray(8))
    assert memory_of([host, host]) == ("DRAM", 0)
    assert memory_of([DeviceBuffer(4096, 8, 1)]) == ("VRAM", 1)
    with pytest.raises(ValueError, match="memory type"):
        memory_of([host, DeviceBuffer(4096, 8, 0)])
    assert ctypes.sizeof(ctypes.c_uint64) == 8


# ---------------------------------------------------------------- with a GPU


@NEEDS_CUDA
async def test_read_into_gpu_memory_registered_as_vram(start: Start) -> None:
    url, _ = await start(ram_bytes=4 << 20)
    ns = namespace()
    toks = tokens(31, 8)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", verify_checksums=False)) as client:
        assert await save(client, toks) == 8
        items, expected = block_reads(client, toks)
        region = torch.full((8 * ns.block_bytes,), 0xAB, dtype=torch.uint8, device="cuda")
        whole = DeviceBuffer.of(region)
        assert client.register_buffer(whole)
        before = client.path_bytes["nixl"]
        got = await client.read_device(items, [whole.slice(i * ns.block_bytes, ns.block_bytes) for i in range(8)])
        assert got == [ns.block_bytes] * 8
        assert region.cpu().numpy().tobytes() == b"".join(expected)
        assert client.path_bytes["nixl"] - before == 8 * ns.block_bytes and client.path_bytes["http"] == 0
        assert client.impl.data.channel is not None
        assert client.impl.data.channel.path.registered_memory == ["VRAM"]  # no per-call registration


@NEEDS_CUDA
async def test_gpu_staging_reads_into_device_and_zeroes_what_missed(start: Start) -> None:
    """A round on a GPU staging region: hits READ straight into the device slots, the miss's device
    slot (holding another request's bytes) is zeroed, nothing travels through the host."""
    from prefixstore.gpu_staging.staging import StagingBuffer

    url, _ = await start(ram_bytes=4 << 20)
    ns = namespace()
    toks = tokens(32, 3)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", device_reads=True, verify_checksums=False)) as client:
        assert await save(client, toks) == 3
        staging = StagingBuffer(8 * ns.block_bytes, device="cuda")
        staging.region.fill_(0xAB)  # an earlier request's bytes
        staging.host.fill_(0xCD)
        assert staging.register_with(client)
        items, expected = block_reads(client, toks)
        missing, _ = block_reads(client, tokens(33, 1))
        slots = staging.carve([ns.block_bytes] * 4)
        assert await staging.receive(client, items + missing, slots) == [True, True, True, False]
        device = staging.region.cpu().numpy()
        assert [device[s.offset : s.end].tobytes() for s in slots[:3]] == expected
        assert not device[slots[3].offset : slots[3].end].any()
        assert client.path_bytes["http"] == 0
        assert staging.host[: slots[2].end].eq(0xCD).all()  # hits never touched the host region


@NEEDS_CUDA
async def test_gpu_staging_lease_lost_mid_read_leaves_zeros_on_the_device(start: Start) -> None:
    from prefixstore.gpu_staging.staging import StagingBuffer

    clock = Clock()
    url, store = await start(clock, ram_bytes=4 << 20)
    ns = namespace()
    toks = tokens(34, 2)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", device_reads=True, verify_checksums=False)) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as other:
        assert await save(client, toks) == 2
        items, expected = block_reads(client, toks)

        async def expire_and_reuse(path: str, answer: dict[str, object]) -> None:
            if path == "/v1/nixl/get" and not getattr(expire_and_reuse, "done", False):
                expire_and_reuse.done = True  # type: ignore[attr-defined]
                await lose_leases_to(store, clock, other, tokens(35, 2))

        interleave_after(client, "/v1/nixl/get", expire_and_reuse)
        staging = StagingBuffer(4 * ns.block_bytes, device="cuda")
        staging.region.fill_(0xAB)
        slots = staging.carve([ns.block_bytes] * 2)
        # The device READ is not proven and the entries are gone: the host retry misses too.
        assert await staging.receive(client, items, slots) == [False, False]
        assert not staging.region[: slots[-1].end].any()
