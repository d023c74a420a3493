"""The LMCache plugin's checks, run in a process of their own (test_connector.py says why).

``python -m tests.lmcache.checks URL DEAD_URL WRITTEN.json OUT.json`` runs every ``check_*``
with LMCache's real classes (engine.py) against the store at URL (``check_dead_store``:
DEAD_URL, where nothing listens) and writes ``{name: "ok" or the failure's traceback}``;
each test in test_connector.py asserts one of them.
"""

from __future__ import annotations

import json
import sys
import traceback
from typing import Any

import torch
from lmcache.v1.storage_backend.connector import ConnectorContext, ConnectorManager

from prefixstore.client import ClientConfig, SyncPrefixClient
from prefixstore.client.lmcache import KEYSPACE, ConnectorSettings, chunk_prompt
from prefixstore.client.lmcache.connector import PrefixStoreConnectorAdapter, PrefixStoreRemoteConnector

from . import engine
from .engine import CHUNK, MODEL, Engine


def check_plugin_and_namespace(url: str, written: Any) -> None:
    lm = Engine(url)
    try:
        manager = ConnectorManager("plugin://prefixstore", lm.loop, lm.cpu, lm.config, lm.metadata,
                                   plugin_name="prefixstore")
        assert any(isinstance(a, PrefixStoreConnectorAdapter) for a in manager.adapters)
        c = lm.connector
        assert isinstance(c, PrefixStoreRemoteConnector) and c.idle_reason is None
        # The data path set up on LMCache's loop as the connector was made, before any put
        # (NIXL where the store serves it, HTTP otherwise: decided either way, no failure counted).
        assert c.prepared is not None and c.prepared.result(timeout=60) == (c.data_path == "nixl")
        assert c.data_path in ("nixl", "http") and not c.failures
        ns = c.namespace
        assert (ns.model, ns.block_tokens, ns.kv.num_layers, ns.kv.num_heads * ns.kv.head_dim, ns.kv.dtype) == \
            (MODEL, CHUNK, engine.LAYERS, engine.HIDDEN, "bfloat16")
        assert KEYSPACE in ns.revision
    finally:
        lm.close()


def check_read_back_byte_exact(url: str, written: list[list[int]]) -> None:
    lm = Engine(url)
    try:
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
    finally:
        lm.close()


def check_unstored_keys_miss(url: str, written: list[list[int]]) -> None:
    lm = Engine(url)
    try:
        other = [key for _, _, key in lm.keys([7] * (2 * CHUNK))]
        assert not lm.remote.contains(other[0])
        assert lm.remote.get_blocking(other[0]) is None
        # The same chunk hash under another dtype is another namespace: never these bytes.
        assert not lm.remote.contains(engine.key_of(written[0][2], torch.float16))
    finally:
        lm.close()


def check_exists_sync(url: str, written: list[list[int]]) -> None:
    """LMCache's ``use_exists_sync`` calls the connector from its own thread."""
    e = Engine(url, use_exists_sync=True)
    try:
        assert e.remote.contains(engine.key_of(written[0][2]))
        assert not e.remote.contains(engine.key_of(12345))
    finally:
        e.close()


def check_layer_major(url: str, written: list[list[int]]) -> None:
    lm = Engine(url)
    try:
        ns = lm.connector.namespace
        start, end, h = written[1]
        with SyncPrefixClient(ns, ClientConfig(url=url, data_path="http")) as client:
            res = client.lookup(chunk_prompt(ns, engine.key_of(h).to_string(), CHUNK), lease=True)
            assert res.kv_tokens == CHUNK
            out = bytearray(ns.block_bytes)
            [(item, _, _)] = res.kv_reads(CHUNK)
            assert client.read([item], [out]) == [ns.block_bytes]
            client.release(res.lease_id)
        # [layers, K|V, tokens, hidden]
        expected = engine.chunk_values(start, end - start).permute(1, 0, 2, 3).contiguous()
        assert bytes(out) == expected.view(torch.uint8).numpy().tobytes()
    finally:
        lm.close()


def check_dead_store(url: str, written: Any) -> None:
    e = Engine(url)
    try:
        key = engine.key_of(4242)
        assert not e.remote.contains(key)
        assert e.remote.get_blocking(key) is None
        e.put(key, 0, CHUNK)  # completes; the save is dropped
        assert e.run(e.remote.batched_async_contains("l", [key])) == 0
        c = e.connector
        assert c.stats["put_dropped"] == 1 and c.stats["errors"] == 0 and sum(c.failures.values()) > 0
        assert c.prepared is not None and c.prepared.result(timeout=60) is False  # a miss-like answer, no error
    finally:
        e.close()


def check_bad_key(url: str, written: Any) -> None:
    """The adapter refuses the key, naming it; LMCache then runs without the remote backend's
    connection (its own handling: a warning and misses), never with a half-read config."""
    bad = {"remote_storage_plugin.prefixstore.urll": "x"}
    try:
        ConnectorSettings.from_extra_config(engine.config(url, **bad).extra_config, "prefixstore")
    except ValueError as err:
        assert "remote_storage_plugin.prefixstore.urll" in str(err), err
    else:
        raise AssertionError("an unknown key was accepted")
    e = Engine(url, **bad)
    assert e.remote.connection is None and not e.remote.contains(engine.key_of(1))
    e.loop.call_soon_threadsafe(e.loop.stop)


def check_compressed_serde_idle(url: str, written: Any) -> None:
    """CacheGen's serde hands a connector compressed bytes, not the KV the namespace describes."""
    lm = Engine(url)
    try:
        cfg = engine.config(url, remote_serde="cachegen")
        ctx = ConnectorContext("plugin://prefixstore", lm.loop, lm.cpu, cfg, lm.metadata, plugin_name="prefixstore")
        c = PrefixStoreConnectorAdapter().create_connector(ctx)
        assert c.namespace is None and "remote_serde" in (c.idle_reason or "")
        assert not lm.run(c.exists(engine.key_of(1))) and lm.run(c.get(engine.key_of(1))) is None
    finally:
        lm.close()


def check_per_rank_namespace(url: str, written: Any) -> None:
    """LMCache's chunks hold one rank's heads: at a world size above 1 each rank keys its own namespace."""
    import dataclasses

    from prefixstore.client.lmcache.connector import namespace_for

    base = engine.metadata()
    shapes, dtypes = [torch.Size([2, engine.LAYERS, CHUNK, engine.HIDDEN])], [engine.DTYPE]
    settings = ConnectorSettings(client=ClientConfig(), model_id=MODEL)

    def revision(**changes: Any) -> str:
        return namespace_for(dataclasses.replace(base, **changes), shapes, dtypes, settings).revision

    alone = revision()
    assert "|tp:" not in alone
    ranks = [revision(world_size=2, worker_id=r) for r in (0, 1)]
    assert ranks == [alone + "|tp:0/2", alone + "|tp:1/2"]
    # MLA: every rank holds the same latent KV, so the ranks share one namespace.
    assert revision(world_size=2, worker_id=1, use_mla=True) == revision(use_mla=True) == alone


CHECKS = {name[len("check_"):]: fn for name, fn in list(globals().items()) if name.startswith("check_")}


def run_all(url: str, dead_url: str, written: list[list[int]]) -> dict[str, str]:
    out = {}
    for name, fn in CHECKS.items():
        try:
            fn(dead_url if name == "dead_store" else url, written)
            out[name] = "ok"
        except Exception:  # noqa: BLE001 -- reported to the test that asserts this check
            out[name] = traceback.format_exc()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 5:
        sys.exit("usage: python -m tests.lmcache.checks URL DEAD_URL WRITTEN.json OUT.json")
    url, dead_url, written_path, out_path = sys.argv[1:]
    with open(written_path) as f:
        results = run_all(url, dead_url, json.load(f))
    with open(out_path, "w") as f:
        json.dump(results, f)
    print("checked")
