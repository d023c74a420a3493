"""The remote storage plugin under LMCache's real classes on CPU, against a real store process.

Chunks are stored by another process (``written``: LMCache's RemoteBackend over the plugin,
keys from LMCache's ChunkedTokenDatabase) and read back here through LMCache's RemoteBackend,
byte-exact. Chunk contents encode their coordinates (engine.py).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("lmcache", reason="LMCache is not installed: tests/lmcache/install_lmcache.sh installs it")

import torch  # noqa: E402
from lmcache.v1.storage_backend.connector import ConnectorManager  # noqa: E402

from prefixstore.client import ClientConfig, SyncPrefixClient  # noqa: E402
from prefixstore.client.lmcache import KEYSPACE, ConnectorSettings, chunk_prompt  # noqa: E402
from prefixstore.client.lmcache.connector import (  # noqa: E402
    PrefixStoreConnectorAdapter,
    PrefixStoreRemoteConnector,
)

from ..serve_process import ServeProcess  # noqa: E402
from . import engine  # noqa: E402
from .engine import CHUNK, MODEL, Engine  # noqa: E402


@pytest.fixture
def lm(store: ServeProcess) -> Iterator[Engine]:
    assert store.url is not None
    e = Engine(store.url)
    yield e
    e.close()


def test_lmcache_loads_the_plugin_and_its_namespace(lm: Engine) -> None:
    manager = ConnectorManager("plugin://prefixstore", lm.loop, lm.cpu, lm.config, lm.metadata,
                               plugin_name="prefixstore")
    assert any(isinstance(a, PrefixStoreConnectorAdapter) for a in manager.adapters)
    c = lm.connector
    assert isinstance(c, PrefixStoreRemoteConnector) and c.idle_reason is None
    ns = c.namespace
    assert (ns.model, ns.block_tokens, ns.kv.num_layers, ns.kv.num_heads * ns.kv.head_dim, ns.kv.dtype) == \
        (MODEL, CHUNK, engine.LAYERS, engine.HIDDEN, "bfloat16")
    assert KEYSPACE in ns.revision


def test_chunks_from_another_process_read_back_byte_exact(lm: Engine, written: list[list[int]]) -> None:
    keys = [engine.key_of(h) for _, _, h in written]
    assert [e - s for s, e, _ in written] == [CHUNK, CHUNK, CHUNK // 2]  # the last chunk is a tail
    for (start, end, _), key in zip(written, keys):
        assert lm.remote.contains(key)
        obj = lm.remote.get_blocking(key)
        assert obj is not None and obj.tensor.shape == (2, engine.LAYERS, end - start, engine.HIDDEN)
        assert torch.equal(obj.tensor, engine.chunk_values(start, end - start)), start
        obj.ref_count_down()
    objs = lm.remote.batched_get_blocking(keys)
    assert [o.tensor.shape[2] for o in objs] == [CHUNK, CHUNK, CHUNK // 2]
    for o in objs:
        o.ref_count_down()
    assert lm.run(lm.remote.batched_async_contains("l", keys + [engine.key_of(12345)])) == 3


def test_keys_nobody_stored_are_misses(lm: Engine, written: list[list[int]]) -> None:
    other = [key for _, _, key in lm.keys([7] * (2 * CHUNK))]
    assert not lm.remote.contains(other[0])
    assert lm.remote.get_blocking(other[0]) is None
    # The same chunk hash under another dtype is another namespace: never these bytes.
    assert not lm.remote.contains(engine.key_of(written[0][2], torch.float16))


def test_exists_sync_path(store: ServeProcess, written: list[list[int]]) -> None:
    """LMCache's ``use_exists_sync`` calls the connector from its own thread."""
    assert store.url is not None
    e = Engine(store.url, use_exists_sync=True)
    try:
        assert e.remote.contains(engine.key_of(written[0][2]))
        assert not e.remote.contains(engine.key_of(12345))
    finally:
        e.close()


def test_the_store_holds_chunks_layer_major(lm: Engine, written: list[list[int]]) -> None:
    ns = lm.connector.namespace
    start, end, h = written[1]
    with SyncPrefixClient(ns, ClientConfig(url=lm.connector.settings.client.url, data_path="http")) as client:
        res = client.lookup(chunk_prompt(ns, engine.key_of(h).to_string(), CHUNK), lease=True)
        assert res.kv_tokens == CHUNK
        out = bytearray(ns.block_bytes)
        [(item, _, _)] = res.kv_reads(CHUNK)
        assert client.read([item], [out]) == [ns.block_bytes]
        client.release(res.lease_id)
    expected = engine.chunk_values(start, end - start).permute(1, 0, 2, 3).contiguous()  # [layers, K|V, tokens, hidden]
    assert bytes(out) == expected.view(torch.uint8).numpy().tobytes()


def test_dead_store_gives_misses_and_drops_saves(dead_url: str) -> None:
    e = Engine(dead_url)
    try:
        key = engine.key_of(4242)
        assert not e.remote.contains(key)
        assert e.remote.get_blocking(key) is None
        e.put(key, 0, CHUNK)  # completes; the save is dropped
        assert e.run(e.remote.batched_async_contains("l", [key])) == 0
        c = e.connector
        assert c.stats["put_dropped"] == 1 and c.stats["errors"] == 0 and sum(c.failures.values()) > 0
    finally:
        e.close()


def test_a_bad_plugin_key_names_itself(store: ServeProcess) -> None:
    """The adapter refuses the key, naming it; LMCache then runs without the remote backend's
    connection (its own handling: a warning and misses), never with a half-read config."""
    assert store.url is not None
    bad = {"remote_storage_plugin.prefixstore.urll": "x"}
    with pytest.raises(ValueError, match="remote_storage_plugin.prefixstore.urll"):
        ConnectorSettings.from_extra_config(engine.config(store.url, **bad).extra_config, "prefixstore")
    e = Engine(store.url, **bad)
    try:
        assert e.remote.connection is None and not e.remote.contains(engine.key_of(1))
    finally:
        e.loop.call_soon_threadsafe(e.loop.stop)


def test_compressed_chunks_make_the_connector_idle(lm: Engine) -> None:
    """CacheGen's serde hands a connector compressed bytes, not the KV the namespace describes."""
    from lmcache.v1.storage_backend.connector import ConnectorContext

    cfg = engine.config(lm.connector.settings.client.url, remote_serde="cachegen")
    ctx = ConnectorContext("plugin://prefixstore", lm.loop, lm.cpu, cfg, lm.metadata, plugin_name="prefixstore")
    c = PrefixStoreConnectorAdapter().create_connector(ctx)
    assert c.namespace is None and "remote_serde" in (c.idle_reason or "")
    assert not lm.run(c.exists(engine.key_of(1))) and lm.run(c.get(engine.key_of(1))) is None
