"""LMCache's own classes on CPU, built the way LMCache builds them, for the plugin's tests.

* Config and metadata: ``LMCacheEngineConfig.from_defaults`` with ``remote_storage_plugins``
  and the plugin's ``extra_config`` keys; ``LMCacheMetadata`` as the vLLM integration fills it.
* Backends: ``CreateStorageBackends`` (LMCache's storage manager does the same): a real
  ``LocalCPUBackend`` (the buffer LMCache allocates chunks from) and a real ``RemoteBackend``
  whose connector LMCache's ``ConnectorManager`` loads from the plugin's module path.
* Keys: LMCache's ``ChunkedTokenDatabase`` over token ids.
* Chunk contents encode their coordinates: ``value(component, layer, position, hidden)``.

``python -m tests.lmcache.engine write URL OUT.json`` is the writer process of the
two-process tests: it stores a sequence of chunks (the last one shorter) through the
RemoteBackend and prints their keys.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from typing import Any

import torch

CHUNK = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
HIDDEN = HEADS * HEAD_DIM
DTYPE = torch.bfloat16
MODEL = "tiny-lmcache"
TOKENS = [(i * 29 + 5) % 1000 for i in range(2 * CHUNK + CHUNK // 2)]  # two chunks and a half


def value(c: Any, l: Any, pos: Any, x: Any) -> Any:
    """A chunk element as a function of its coordinates; integers in [-125, 125] are exact in bf16."""
    return (c * 7 + l * 13 + pos * 3 + x * 5) % 251 - 125


def chunk_values(first_pos: int, num_tokens: int) -> torch.Tensor:
    """An LMCache chunk [2, layers, tokens, hidden] (KV_2LTD) starting at ``first_pos``."""
    c = torch.arange(2).reshape(2, 1, 1, 1)
    l = torch.arange(LAYERS).reshape(1, LAYERS, 1, 1)
    t = torch.arange(num_tokens).reshape(1, 1, num_tokens, 1) + first_pos
    x = torch.arange(HIDDEN).reshape(1, 1, 1, HIDDEN)
    return value(c, l, t, x).to(DTYPE)


def config(url: str, remote_serde: str = "naive", **extra: object) -> Any:
    from lmcache.v1.config import LMCacheEngineConfig

    from prefixstore.client.lmcache import ADAPTER_CLASS, ADAPTER_MODULE

    p = "remote_storage_plugin.prefixstore."
    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, save_unfull_chunk=True, local_cpu=True, max_local_cpu_size=0.05, remote_serde=remote_serde,
        remote_storage_plugins=["prefixstore"],
        extra_config={p + "module_path": ADAPTER_MODULE, p + "class_name": ADAPTER_CLASS, p + "url": url,
                      p + "connect_timeout_s": 0.5, p + "timeout_s": 2.0,
                      **{k if k.startswith(("remote_storage_plugin.", "use_")) else p + k: v
                         for k, v in extra.items()}})


def metadata(dtype: torch.dtype = DTYPE) -> Any:
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0, local_worker_id=0,
                           kv_dtype=dtype, kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK,
                           role="worker")


class Engine:
    """LMCache's storage backends on their own event loop thread, as LMCache's storage manager runs them."""

    def __init__(self, url: str, dtype: torch.dtype = DTYPE, remote_serde: str = "naive", **extra: object) -> None:
        from lmcache.v1.storage_backend import CreateStorageBackends

        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self.config = config(url, remote_serde, **extra)
        self.metadata = metadata(dtype)
        self.backends = CreateStorageBackends(self.config, self.metadata, self.loop, dst_device="cpu")
        self.cpu = self.backends["LocalCPUBackend"]
        self.remote = self.backends["RemoteBackend-prefixstore"]

    @property
    def connector(self) -> Any:
        return self.remote.connection.getWrappedConnector()

    def keys(self, tokens: list[int]) -> list[tuple[int, int, Any]]:
        from lmcache.v1.token_database import ChunkedTokenDatabase

        return list(ChunkedTokenDatabase(self.config, self.metadata).process_tokens(tokens))

    def put(self, key: Any, first_pos: int, num_tokens: int) -> None:
        obj = self.cpu.allocate(torch.Size([2, LAYERS, num_tokens, HIDDEN]), DTYPE)
        obj.tensor.copy_(chunk_values(first_pos, num_tokens))
        self.remote.submit_put_task(key, obj).result(30)
        obj.ref_count_down()  # the caller's reference, as LMCache's storage manager drops it

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.run(self.remote.connection.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


def key_of(chunk_hash: int, dtype: torch.dtype = DTYPE) -> Any:
    from lmcache.utils import CacheEngineKey

    return CacheEngineKey(model_name=MODEL, world_size=1, worker_id=0, chunk_hash=chunk_hash, dtype=dtype)


def write(url: str) -> list[tuple[int, int, int]]:
    e = Engine(url)
    out = []
    for start, end, key in e.keys(TOKENS):
        e.put(key, start, end - start)
        out.append((start, end, key.chunk_hash))
    stats = e.connector.stats
    assert stats["puts"] == len(out) and stats["put_dropped"] == stats["errors"] == 0, stats
    e.close()
    return out


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "write":
        sys.exit("usage: python -m tests.lmcache.engine write URL OUT.json")
    with open(sys.argv[3], "w") as f:
        json.dump(write(sys.argv[2]), f)
    print("written")
