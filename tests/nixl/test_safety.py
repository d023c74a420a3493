"""NIXL path safety with the store in this process (a clock the test moves): leases that expire
mid-transfer, corrupt WRITEs, staging zeroing, fallback to HTTP, authentication, bad input."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

import prefixstore.transport.nixl_agent as nixl_agent
from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol.errors import Reason

from ..security.helpers import TOKENS, raw_post, write_tenants
from .conftest import NEEDS_NIXL, Clock, Start
from .helpers import block_reads, interleave_after, lose_leases_to, namespace, read, save, tokens

pytestmark = NEEDS_NIXL


@pytest.mark.parametrize(("verify", "chunk_bytes"), [(True, None), (True, 8192), (False, None)])
async def test_lease_expiring_mid_transfer_fails_the_read_cleanly(start: Start, verify: bool, chunk_bytes: int | None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Between the descriptors and the READ the lease expires, the entries go and another chain
    takes their pages. The READ then copies the other chain's bytes: caught by the checksum (or,
    without checksums, by the lease no longer being held at release), zeroed, counted a miss.
    ``chunk_bytes``: READ and hashed in chunks of two blocks (client/nixl_path.py)."""
    if chunk_bytes is not None:
        import prefixstore.client.nixl_path as nixl_path

        monkeypatch.setattr(nixl_path, "HASH_CHUNK_BYTES", chunk_bytes)
    clock = Clock()
    url, store = await start(clock)
    ns = namespace()
    toks = tokens(5, 8)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl", verify_checksums=verify)) as client, \
            PrefixClient(ns, ClientConfig(url=url, data_path="http")) as other:
        assert await save(client, toks) == 8
        items, expected = block_reads(client, toks)
        overwritten = []

        async def expire_and_reuse(path: str, answer: dict[str, object]) -> None:
            overwritten.extend(await lose_leases_to(store, clock, other, tokens(6, 8)))

        interleave_after(client, "/v1/nixl/get", expire_and_reuse)
        got, outs = await read(client, items, ns.block_bytes)
        assert overwritten and overwritten != expected
        assert got == [-1] * 8
        assert all(not o.any() for o in outs)  # zeroed: neither old, new, nor mixed bytes
        assert client.failures["checksum" if verify else "read"] >= 1
        store.check()


async def test_corrupt_write_is_rejected_at_commit(start: Start) -> None:
    """A payload whose bytes change between its checksum and its WRITE is dropped by the store."""
    url, store = await start()
    ns = namespace()
    toks = tokens(7, 2)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        prompt = client.prompt(toks)
        specs = [spec for spec, _, _ in prompt.kv_items(len(toks))]
        payloads = [np.full(ns.block_bytes, 3, dtype=np.uint8) for _ in specs]

        async def scribble(path: str, answer: dict[str, object]) -> None:
            payloads[1][0] ^= 0xFF  # after the checksum travelled, before the WRITE

        interleave_after(client, "/v1/nixl/reserve", scribble)
        results = await client.put(list(zip(specs, payloads)))
        assert [r.status for r in results] == ["ok", "rejected"]
        assert results[1].reason is Reason.CHECKSUM
        assert len(store.index.entries) == 1 and not store.pending
        store.check()


async def test_staging_regions_not_covered_by_a_read_are_zeroed(start: Start) -> None:
    """gpu_staging over NIXL: the staging region is registered once; a round with a miss lands
    the payloads and zeroes the slot nothing was READ into (it held another request's bytes)."""
    pytest.importorskip("torch")
    from prefixstore.gpu_staging.staging import StagingBuffer

    url, _ = await start()
    ns = namespace()
    toks = tokens(8, 3)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        assert await save(client, toks) == 3
        staging = StagingBuffer(8 * ns.block_bytes, device="cpu")
        staging.host.fill_(0xAB)  # an earlier request's bytes
        assert staging.register_with(client) and not staging.register_with(client)
        items, expected = block_reads(client, toks)
        missing, _ = block_reads(client, tokens(9, 1))
        slots = staging.carve([ns.block_bytes] * 4)
        got = await client.read(items + missing, [staging.host_view(s) for s in slots])
        assert staging.land(slots, got) == [True, True, True, False]
        assert [staging.host_view(s).tobytes() for s in slots[:3]] == expected
        assert not staging.host_view(slots[3]).any()
        assert staging.zeroed_bytes == ns.block_bytes
        assert client.path_bytes["nixl"] >= 3 * ns.block_bytes and client.path_bytes["http"] == 0
        assert client.impl.data.channel is not None and len(client.impl.data.channel.path.registered_memory) == 1  # registered once


async def test_store_without_nixl_serves_the_same_results_over_http(
        start: Start, caplog: pytest.LogCaptureFixture) -> None:
    url, _ = await start(nixl="off")
    ns = namespace()
    toks = tokens(10, 3)
    caplog.set_level(logging.INFO, logger="prefixstore.client")
    async with PrefixClient(ns, ClientConfig(url=url, data_path="auto")) as auto, \
            PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as strict:
        assert await save(auto, toks) == 3
        items, expected = block_reads(auto, toks)
        for client in (auto, strict):
            got, outs = await read(client, items, ns.block_bytes)
            assert got == [ns.block_bytes] * 3 and [o.tobytes() for o in outs] == expected
            got, _ = await read(client, items, ns.block_bytes)  # decided once, not per call
            assert client.data_path == "http" and client.path_bytes["nixl"] == 0
        assert auto.failures == {}  # auto: HTTP is an answer, not a failure
        assert strict.failures["nixl"] == 1  # asked for NIXL: counted (once) and warned
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefixstore data path")]
    assert len(lines) == 2 and all(line.startswith("prefixstore data path: http") for line in lines)


async def test_client_without_nixl_uses_http(start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    def absent() -> object:
        raise ImportError("No module named 'nixl'")

    url, _ = await start()  # the store serves NIXL; then, for this client, the package is "gone"
    monkeypatch.setattr(nixl_agent, "_import_api", absent)  # as if the package were not installed
    ns = namespace()
    toks = tokens(11, 2)
    async with PrefixClient(ns, ClientConfig(url=url)) as client:
        assert await save(client, toks) == 2
        items, expected = block_reads(client, toks)
        got, outs = await read(client, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 2 and [o.tobytes() for o in outs] == expected
        assert client.data_path == "http" and client.failures == {}
        assert client.path_bytes["http"] == 4 * ns.block_bytes  # 2 put + 2 read


async def test_nixl_endpoints_need_the_tenant_token_and_name_bad_fields(start: Start, tmp_path: Path) -> None:
    url, _ = await start(tenants_file=str(write_tenants(tmp_path / "tenants.toml")))
    token = TOKENS["alpha"]
    assert (await raw_post(url, "/v1/nixl/metadata", {}, None)).status == 401
    assert (await raw_post(url, "/v1/nixl/metadata", {}, "not-a-token")).status == 401
    ok = await raw_post(url, "/v1/nixl/metadata", {}, token)
    assert ok.status == 200 and isinstance(ok.body["metadata"], bytes) and ok.body["agent"]
    ns = namespace(tenant="alpha")
    bad = [("/v1/nixl/get", {"ns": ns.id, "items": [[b"x", 0, None]]}, 404, "ns"),  # not registered yet
           ("/v1/nixl/get", {"ns": b"short"}, 400, "ns"),
           ("/v1/nixl/commit", {"ns": ns.id, "keys": [b"short"]}, 404, "ns")]
    for path, header, status, field in bad:
        answer = await raw_post(url, path, header, token)
        assert (answer.status, answer.body.get("field")) == (status, field), (path, answer)
    assert (await raw_post(url, "/v1/namespaces", {"namespace": ns.to_wire()}, token)).status == 200
    for path, header, field in [("/v1/nixl/get", {"ns": ns.id, "items": [[b"x", 0, None]]}, "items[0].key"),
                                ("/v1/nixl/reserve", {"ns": ns.id, "items": [{"kind": 9}]}, "items[0].kind"),
                                ("/v1/nixl/commit", {"ns": ns.id, "keys": [b"short"]}, "keys[0]")]:
        answer = await raw_post(url, path, header, token)
        assert (answer.status, answer.body.get("field")) == (400, field), (path, answer)
    other = namespace(tenant="beta")  # another tenant's namespace is unknown to alpha
    assert (await raw_post(url, "/v1/nixl/get", {"ns": other.id, "items": []}, token)).status == 404


async def test_chunked_read_keeps_verified_chunks_and_retries_the_rest_over_http(
        start: Start, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hashed READs go in chunks (chunk k hashed while k+1 transfers). A transfer that fails at the
    third chunk keeps the two verified chunks and hands the rest to HTTP: every byte right."""
    import prefixstore.client.nixl_path as nixl_path

    monkeypatch.setattr(nixl_path, "HASH_CHUNK_BYTES", 2 * 4096)  # two 4 KiB blocks a chunk
    url, store = await start(ram_bytes=1 << 20)
    ns = namespace()
    toks = tokens(11, 8)
    async with PrefixClient(ns, ClientConfig(url=url, data_path="nixl")) as client:
        assert await save(client, toks) == 8
        items, expected = block_reads(client, toks)
        got, outs = await read(client, items, ns.block_bytes)
        assert got == [ns.block_bytes] * 8 and [o.tobytes() for o in outs] == expected
        assert client.impl.data.channel is not None
        path = client.impl.data.channel.path
        real = path.transfer
        calls: list[int] = []

        async def third_fails(op, local, remote, spans, *rest):  # type: ignore[no-untyped-def]
            calls.append(len(spans))
            if len(calls) == 3:
                raise nixl_path.TransferFailed("the remote agent went away (test)")
            return await real(op, local, remote, spans, *rest)

        monkeypatch.setattr(path, "transfer", third_fails)
        before = dict(client.path_bytes)
        got, outs = await read(client, items, ns.block_bytes)
        assert calls == [2, 2, 2]  # chunks of two payloads; the failure stopped the rest
        assert got == [ns.block_bytes] * 8 and [o.tobytes() for o in outs] == expected
        assert client.path_bytes["nixl"] - before["nixl"] == 4 * ns.block_bytes
        assert client.path_bytes["http"] - before.get("http", 0) == 4 * ns.block_bytes
        store.check()
