"""The HiCache backend under SGLang's real classes on CPU, against a real store process.

Pages are written by another process (``written``: SGLang's HiCacheController backing a
sequence up through the backend; a hybrid sequence through the backend's v2 calls as
SGLang's HybridCacheController makes them) and read back here, byte-exact, into host pools
of every layout. Page contents encode their coordinates (engine.py), so the checks do not
depend on the backend's own layout code.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed: tests/sglang/install_sglang.sh installs it")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from prefixstore.client import ClientConfig, SyncPrefixClient  # noqa: E402
from prefixstore.client.sglang import KEYSPACE, page_prompt  # noqa: E402
from prefixstore.client.sglang.backend import PrefixStoreHiCache, model_state_shards  # noqa: E402

from ..nixl.conftest import NEEDS_NIXL  # noqa: E402
from ..serve_process import ServeProcess, StartServe  # noqa: E402
from . import engine  # noqa: E402
from .engine import MODEL, PAGE  # noqa: E402

HYBRID = MODEL + "-hybrid"


@pytest.fixture(scope="module", autouse=True)
def _one_process_group() -> Iterator[None]:
    """SGLang's controllers share one gloo group here; it goes when this module is done, so an engine
    tested later in the same process (vLLM's) initialises torch.distributed its own way."""
    yield
    engine.close_dist()


def info(prefix: list[str] | None) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def mamba_transfer(key: str, slot: torch.Tensor | None = None) -> PoolTransfer:
    return PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[key], hit_policy=PoolHitPolicy.TRAILING_PAGES)


def test_sglang_factory_builds_the_backend_and_its_namespace(store: ServeProcess) -> None:
    assert store.url is not None
    _, host = engine.kv_pools("page_first")
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend("dynamic", engine.storage_config(store.url), host)
    assert isinstance(b, PrefixStoreHiCache)
    assert b.idle_reason is not None and b.batch_exists(["k"], info([])) == 0  # no pools yet: a miss
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    ns = b.namespace
    assert b.idle_reason is None and ns is not None
    assert (ns.model, ns.block_tokens, ns.kv.num_layers, ns.kv.num_heads, ns.kv.head_dim, ns.kv.dtype) == \
        (MODEL, PAGE, engine.LAYERS, engine.HEADS, engine.HEAD_DIM, "bfloat16")
    assert KEYSPACE in ns.revision and not ns.has_state
    b.close()


@pytest.mark.parametrize("layout", engine.LAYOUTS)
def test_controller_prefetches_pages_another_process_backed_up(store: ServeProcess, written: dict[str, Any],
                                                              layout: str) -> None:
    """SGLang's controller, its threads and its hashing: prefetch, then every page byte-exact."""
    assert store.url is not None
    ctrl = engine.controller(store.url, layout)
    try:
        tokens = written["tokens"] + [1, 2, 3] * PAGE  # two more pages nobody stored
        op, idx = engine.prefetch(ctrl, tokens)
        assert op.storage_hit_count == len(written["tokens"]) == op.completed_tokens
        assert idx is not None
        host = ctrl.mem_pool_host
        for j in range(len(written["tokens"]) // PAGE):
            assert torch.equal(engine.read_page(host, int(idx[j * PAGE])), engine.canonical_page(j * PAGE)), j
    finally:
        ctrl.storage_backend.close()


def test_exists_counts_stored_pages_from_the_prefix_on(store: ServeProcess, written: dict[str, Any]) -> None:
    assert store.url is not None
    keys = written["keys"]
    _, host = engine.kv_pools("page_first")
    b = engine.backend(store.url, host)
    try:
        assert b.batch_exists(keys, info([])) == 6
        assert b.batch_exists(keys[2:], info(keys[:2])) == 4
        # The same keys under another prefix name another chain: not stored.
        assert b.batch_exists(keys[2:], info([])) == 0
        # A sequence that forks after page 3: its first three pages are found.
        forked = written["tokens"][: 3 * PAGE] + [5] * (3 * PAGE)
        forked_keys = get_storage_hash_str(forked, None, page_size=PAGE)
        assert b.batch_exists(forked_keys, info([])) == 3
        assert b.batch_exists(forked_keys[2:], info(forked_keys[:2])) == 1  # counted from the call's first key
    finally:
        b.close()


def test_the_store_holds_pages_layer_major(store: ServeProcess, written: dict[str, Any]) -> None:
    """What the namespace says: one page is [layers, K|V, tokens, heads, dim], whatever SGLang's layout."""
    assert store.url is not None
    _, host = engine.kv_pools("page_head")
    b = engine.backend(store.url, host)
    b.close()
    with SyncPrefixClient(b.namespace, ClientConfig(url=store.url, data_path="http")) as client:
        res = client.lookup(page_prompt(b.namespace, written["keys"]), lease=True)
        assert res.matched_blocks == 6
        reads = res.kv_reads(6 * PAGE)
        outs = [bytearray(b.namespace.block_bytes) for _ in reads]
        assert client.read([item for item, _, _ in reads], outs) == [b.namespace.block_bytes] * 6
        client.release(res.lease_id)
    for j, out in enumerate(outs):
        assert bytes(out) == engine.canonical_page(j * PAGE).contiguous().view(torch.uint8).numpy().tobytes(), j


def test_another_kv_dtype_is_another_namespace(store: ServeProcess, written: dict[str, Any]) -> None:
    """The namespace describes the host pool exactly: float16 pages never read bfloat16 bytes."""
    assert store.url is not None
    _, host = engine.kv_pools("page_first", dtype=torch.float16)
    b = engine.backend(store.url, host)
    try:
        assert b.namespace is not None and b.namespace.kv.dtype == "float16"
        assert b.batch_exists(written["keys"], info([])) == 0
        assert b.batch_get_v1(written["keys"], host.alloc(6 * PAGE), info([])) == [False] * 6
    finally:
        b.close()


def test_without_prefix_keys_every_call_misses_and_names_the_knob(store: ServeProcess, written: dict[str, Any],
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    assert store.url is not None
    _, host = engine.kv_pools("page_first")
    b = engine.backend(store.url, host)
    try:
        with caplog.at_level(logging.WARNING, logger="prefixstore.client.sglang.backend"):
            assert b.batch_exists(written["keys"], info(None)) == 0
            assert b.batch_get_v1(written["keys"], host.alloc(6 * PAGE), info(None)) == [False] * 6
        assert "hicache_storage_pass_prefix_keys" in caplog.text
    finally:
        b.close()


def test_dead_store_gives_misses_and_leaves_host_pages_alone(dead_url: str) -> None:
    """Nothing listens: every call answers a miss, nothing raises, and no host byte changes."""
    _, host = engine.kv_pools("page_first")
    mamba = engine.mamba_host_pool("page_first")
    b = engine.backend(dead_url, host, mamba)
    keys = get_storage_hash_str(list(range(4 * PAGE)), None, page_size=PAGE)
    idx = host.alloc(4 * PAGE)
    engine.fill_pages(host, idx, 0)
    before = host.kv_buffer.clone()
    slot = mamba.alloc(1)
    try:
        assert b.batch_exists(keys, info([])) == 0
        assert b.batch_get_v1(keys, idx, info([])) == [False] * 4
        assert b.batch_set_v1(keys, idx, info([])) == [False] * 4
        res = b.batch_exists_v2(keys, [mamba_transfer("__placeholder__")], info([]))
        assert (res.kv_hit_pages, res.restorable_prefix_pages) == (0, [])
        assert b.batch_get_v2([mamba_transfer(keys[3], slot)], info(keys[:3])) == {PoolName.MAMBA: [False]}
        assert torch.equal(host.kv_buffer, before)
        assert sum(b.failures.values()) > 0 and b.stats["errors"] == 0
    finally:
        b.close()


def test_controller_against_a_dead_store_prefetches_nothing(dead_url: str) -> None:
    ctrl = engine.controller(dead_url, "page_first")
    try:
        tokens = list(range(3 * PAGE))
        idx = ctrl.mem_pool_host.alloc(len(tokens))
        ctrl.write_storage(idx, tokens, get_storage_hash_str(tokens, None, page_size=PAGE), [])
        assert engine.wait_backup(ctrl).completed_tokens == 0
        op, _ = engine.prefetch(ctrl, tokens)
        assert op.storage_hit_count == 0
    finally:
        ctrl.storage_backend.close()


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_hybrid_state_from_another_process(store: ServeProcess, written: dict[str, Any], layout: str) -> None:
    """KV pages and the Mamba state at their end, saved by another process; the store's state boundary is
    SGLang's restorable prefix, and the state reads back byte-exact."""
    assert store.url is not None
    keys = written["hybrid_keys"]
    _, host = engine.kv_pools(layout)
    mamba = engine.mamba_host_pool(layout)
    b = engine.backend(store.url, host, mamba, model=HYBRID)
    try:
        assert b.namespace is not None and b.namespace.has_state
        res = b.batch_exists_v2(keys, [mamba_transfer("__placeholder__")], info([]))
        assert res.kv_hit_pages == 4 and res.restorable_prefix_pages == [4]
        assert res.extra_pool_hit_pages[PoolName.MAMBA] == 4
        # Two pages have KV but no state at their end: not restorable on a hybrid model.
        early = b.batch_exists_v2(keys[:2], [mamba_transfer("__placeholder__")], info([]))
        assert (early.kv_hit_pages, early.restorable_prefix_pages) == (0, [])

        idx = host.alloc(4 * PAGE)
        assert b.batch_get_v1(keys, idx, info([])) == [True] * 4
        for j in range(4):
            assert torch.equal(engine.read_page(host, int(idx[j * PAGE])), engine.canonical_page(j * PAGE))
        slot = mamba.alloc(1)
        assert b.batch_get_v2([mamba_transfer(keys[3], slot)], info(keys[:3])) == {PoolName.MAMBA: [True]}
        expected = engine.state_values(written["state_seed"], engine.mamba_shapes(mamba))
        flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in expected])
        assert torch.equal(mamba.get_data_page(int(slot[0])), flat)
        # No state was saved at page 2's end.
        assert b.batch_get_v2([mamba_transfer(keys[1], slot)], info(keys[:1])) == {PoolName.MAMBA: [False]}
    finally:
        b.close()


def test_the_store_holds_the_state_layer_major(store: ServeProcess, written: dict[str, Any]) -> None:
    assert store.url is not None
    _, host = engine.kv_pools("page_first")
    mamba = engine.mamba_host_pool("page_first")
    b = engine.backend(store.url, host, mamba, model=HYBRID)
    b.close()
    ns = b.namespace
    with SyncPrefixClient(ns, ClientConfig(url=store.url, data_path="http")) as client:
        res = client.lookup(page_prompt(ns, written["hybrid_keys"]), lease=True)
        assert res.state_tokens == 4 * PAGE
        out = bytearray(ns.state.snapshot_bytes)
        assert client.read([res.state_read()], [out]) == [ns.state.snapshot_bytes]
        client.release(res.lease_id)
    expected = engine.canonical_state(engine.state_values(written["state_seed"], engine.mamba_shapes(mamba)))
    assert bytes(out) == expected.numpy().tobytes()


def test_a_state_offered_before_its_page_is_saved_with_it(store: ServeProcess) -> None:
    """SGLang backs up the Mamba pool before KV: the state waits for its page, then is stored."""
    assert store.url is not None
    _, host = engine.kv_pools("page_first")
    mamba = engine.mamba_host_pool("page_first")
    b = engine.backend(store.url, host, mamba, model=HYBRID + "-pending")
    keys = get_storage_hash_str(list(range(2 * PAGE)), None, page_size=PAGE)
    idx = host.alloc(2 * PAGE)
    slot = mamba.alloc(1)
    engine.fill_state(mamba, int(slot[0]), slot_seed=9)
    try:
        assert b.batch_set_v2([mamba_transfer(keys[1], slot)], info(keys[:1])) == {PoolName.MAMBA: [True]}
        assert b.stats["states_pending"] == 1 and b.stats["states_written"] == 0
        assert b.batch_set_v1(keys, idx, info([])) == [True, True]
        assert b.stats["states_written"] == 1
        res = b.batch_exists_v2(keys, [mamba_transfer("__placeholder__")], info([]))
        assert res.restorable_prefix_pages == [2]
    finally:
        b.close()


@NEEDS_NIXL
def test_pages_over_nixl(serve: StartServe) -> None:
    """The client's NIXL path where both sides have it: one WRITE and one READ per batch, no HTTP bytes."""
    nixl_store = serve("--port", "0", "--data-dir", "none", "--nixl", "on")
    assert nixl_store.url is not None
    _, host = engine.kv_pools("page_first")
    b = engine.backend(nixl_store.url, host, data_path="nixl")
    # The data path is set up as the host pool is registered, before SGLang's first backup.
    assert b.prepared is not None and b.prepared.result(timeout=60) is True
    assert sum(b.path_bytes.values()) == 0
    keys = get_storage_hash_str(list(range(1000, 1000 + 4 * PAGE)), None, page_size=PAGE)
    idx = host.alloc(4 * PAGE)
    engine.fill_pages(host, idx, 0)
    try:
        assert b.batch_set_v1(keys, idx, info([])) == [True] * 4
        _, other = engine.kv_pools("page_head")
        reader = engine.backend(nixl_store.url, other, data_path="nixl")
        try:
            idx2 = other.alloc(4 * PAGE)
            assert reader.batch_get_v1(keys, idx2, info([])) == [True] * 4
            for j in range(4):
                assert torch.equal(engine.read_page(other, int(idx2[j * PAGE])), engine.canonical_page(j * PAGE))
            for x in (b, reader):
                assert x.path_bytes["nixl"] == 4 * x.namespace.block_bytes and x.path_bytes["http"] == 0
                assert x.failures.total() == 0
        finally:
            reader.close()
    finally:
        b.close()


def test_the_model_config_is_read_from_disk_never_from_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang has read its model's config before the backend does: a name found in no directory and
    no cache is SGLang's own state bytes at once, and the Hub is never asked for its files (an
    offline host's engine waited through the Hub client's retries, about 23 s, at its start)."""
    from huggingface_hub import constants, file_download

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as on a host that never set it
    asked: list[object] = []

    def no_network(*args: object, **kwargs: object) -> object:
        asked.append(args[:1])
        raise OSError("this test has no network")

    monkeypatch.setattr(file_download, "get_hf_file_metadata", no_network)
    assert model_state_shards("prefixstore-tests/in-no-cache", engine.mamba_host_pool("page_first")) is None
    assert asked == []
