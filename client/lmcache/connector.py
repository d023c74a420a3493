"""The LMCache remote storage plugin: LMCache uses prefixstore as its remote tier.

Registered through LMCache's own plugin loading (``remote_storage_plugins``;
no LMCache patch)::

    remote_storage_plugins: ["prefixstore"]
    extra_config:
      remote_storage_plugin.prefixstore.module_path: prefixstore.client.lmcache.connector
      remote_storage_plugin.prefixstore.class_name: PrefixStoreConnectorAdapter
      remote_storage_plugin.prefixstore.url: http://store:8077

LMCache's ``ConnectorManager`` imports the module, instantiates the
``ConnectorAdapter`` and asks it for a connector for ``plugin://prefixstore``;
its ``RemoteBackend`` then drives the connector's coroutines on LMCache's own
event loop thread, which is where the async :class:`PrefixClient` runs too::

    exists / batched_async_contains   leaseless lookups        (no side effect on the store)
    get / batched_get                 leased lookup + one read -> a MemoryObj from LMCache's CPU pool
    put / batched_put                 offer + put              <- the MemoryObj's tensor

Payloads: an LMCache chunk is ``[2, layers, tokens, hidden]`` (KV_2LTD; MLA:
``[1, layers, tokens, hidden]``); the store's is layer-major
``[layers, 2, tokens, hidden]`` (protocol/namespace.py), so put and get permute
with one copy. Keys: keys.py (each chunk one entry under the namespace root,
keyed by LMCache's chunk key).

Not moved: chunks of several KV layer groups (LMCache's hybrid layouts), and
LMCache's multi-process mode, whose L2 adapters are a different interface
(docs/lmcache.md). The connector then answers every call with a miss.

Failure is a miss, always: a store that is down or answers wrongly gives
``exists`` False, ``get`` None (the MemoryObj given back to LMCache's pool),
``put`` a dropped save; never an exception into LMCache and never unverified
bytes (every payload is checked against its xxh3 before it is copied in).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
from typing import Any

import torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext, extract_plugin_type
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from prefixstore.protocol.namespace import KVLayout, Namespace
from ..client import PrefixClient
from .keys import KEYSPACE, chunk_prompt
from .settings import ConnectorSettings

log = logging.getLogger(__name__)

PLUGIN_TYPE = "prefixstore"

#: torch dtype -> the dtype name a namespace records (protocol.namespace.DTYPE_BYTES).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int8: "int8",
    torch.uint8: "uint8",
}

STAT_KEYS = ("exists_calls", "exists_hits", "gets", "get_hits", "get_failures", "puts", "put_stored", "put_dropped",
             "errors")


class Unsupported(ValueError):
    """A cache layout this connector does not move (it then answers every call with a miss)."""


class PrefixStoreConnectorAdapter(ConnectorAdapter):
    """LMCache's plugin entry point (``class_name``): makes a connector for ``plugin://prefixstore[.x]``."""

    def __init__(self) -> None:
        super().__init__(f"plugin://{PLUGIN_TYPE}")

    def can_parse(self, url: str) -> bool:
        return url.startswith("plugin://") and extract_plugin_type(url[len("plugin://"):]) == PLUGIN_TYPE

    def create_connector(self, context: ConnectorContext) -> RemoteConnector:
        plugin = context.plugin_name or context.url[len("plugin://"):]
        config = context.config
        settings = ConnectorSettings.from_extra_config(config.extra_config if config is not None else None, plugin)
        return PrefixStoreRemoteConnector(context, settings)


def namespace_for(metadata: Any, shapes: list[torch.Size], dtypes: list[torch.dtype],
                  settings: ConnectorSettings) -> Namespace:
    """The namespace every LMCache worker of this model and rank keys its chunks under."""
    if len(shapes) != 1 or len(dtypes) != 1:
        raise Unsupported(f"{len(shapes)} KV layer groups (one is moved)")
    kv_size, num_layers, chunk_tokens, hidden = shapes[0]
    dtype = dtypes[0]
    if dtype not in DTYPE_NAMES:
        raise Unsupported(f"KV dtype {dtype}")
    heads, head_dim = (metadata.kv_shape[3], metadata.kv_shape[4]) if not metadata.use_mla else (1, hidden)
    if heads * head_dim != hidden:
        heads, head_dim = 1, hidden
    model = settings.model_id or str(metadata.model_name or "")
    if not model:
        raise ValueError("model_id: LMCache names no model here; set remote_storage_plugin.<name>.model_id")
    # LMCache's chunks are its own memory objects (its KV format, one rank's heads) under its own
    # per-rank keys, not the store's head-addressable layout: each rank keeps its own namespace,
    # named in the revision (the store's namespaces no longer carry a rank). MLA: every rank holds
    # the same latent KV, so ranks share one namespace.
    revision = f"{settings.revision}|{KEYSPACE}"
    if not metadata.use_mla and metadata.world_size > 1:
        revision += f"|tp:{metadata.worker_id}/{metadata.world_size}"
    return Namespace(model=model, revision=revision,
                     kv=KVLayout(num_layers=int(num_layers), num_heads=int(heads), head_dim=int(head_dim),
                                 dtype=DTYPE_NAMES[dtype], num_components=int(kv_size)),
                     block_tokens=int(chunk_tokens), tenant=settings.tenant)


class PrefixStoreRemoteConnector(RemoteConnector):
    """LMCache's ``RemoteConnector`` over prefixstore's async client."""

    def __init__(self, context: ConnectorContext, settings: ConnectorSettings) -> None:
        super().__init__(context.config, context.metadata)
        self.loop = context.loop
        self.local_cpu_backend = context.local_cpu_backend
        self.settings = settings
        self.stats: collections.Counter[str] = collections.Counter({k: 0 for k in STAT_KEYS})
        self.namespace: Namespace | None = None
        self.idle_reason: str | None = None
        self._client: PrefixClient | None = None
        self.prepared: concurrent.futures.Future[bool] | None = None
        """The client's data path set-up, started here on LMCache's loop (whether payloads will take NIXL)."""
        try:
            serde = getattr(context.config, "remote_serde", "naive")
            if serde not in ("naive", None):  # cachegen & co. hand over compressed bytes, not KV tensors
                raise Unsupported(f"remote_serde {serde!r} (set remote_serde: naive)")
            if getattr(context.config, "use_layerwise", False):
                raise Unsupported("use_layerwise (per-layer chunks; set use_layerwise: false)")
            self.namespace = namespace_for(context.metadata, self.meta_shapes, self.meta_dtypes, settings)
        except Unsupported as err:
            self.idle_reason = str(err)
            log.warning("prefixstore LMCache connector idle (every call is a miss): %s", err)
            return
        self._client = PrefixClient(self.namespace, settings.client)
        # The data path set up on LMCache's loop while the engine starts: its first put then does not
        # import nixl and make the agent, and a store that is down holds nothing up. close() cancels it.
        self.prepared = asyncio.run_coroutine_threadsafe(self._client.prepare(), self.loop)
        self._kv_size = int(self.meta_shapes[0][0])
        self._hidden = int(self.meta_shapes[0][3])
        log.info("prefixstore LMCache connector: namespace %s (%s, chunk %d tokens)", self.namespace.id_hex,
                 self.namespace.model, self.namespace.block_tokens)

    def __repr__(self) -> str:
        return f"<PrefixStoreRemoteConnector {self.settings.client.url}>"

    @property
    def failures(self) -> collections.Counter[str]:
        """The client's store failures by operation (empty while idle)."""
        return self._client.failures if self._client is not None else collections.Counter()

    @property
    def data_path(self) -> str:
        """Where payloads go: 'nixl', 'http', 'undecided' until the set-up (``prepared``) or the first
        transfer decides it; 'idle' while the connector is idle."""
        return self._client.data_path if self._client is not None else "idle"

    def _failed(self, op: str, err: BaseException) -> None:
        self.stats["errors"] += 1
        log.warning("prefixstore LMCache %s failed, treated as a miss: %s: %s", op, type(err).__name__, err)

    def _prompt(self, key: CacheEngineKey, num_tokens: int | None = None) -> Any:
        assert self.namespace is not None
        return chunk_prompt(self.namespace, key.to_string(), num_tokens or self.namespace.block_tokens)

    # ------------------------------------------------------------ queries

    async def exists(self, key: CacheEngineKey) -> bool:
        """Whether the chunk is stored (a full chunk or a sequence's last, shorter one). No side effect."""
        self.stats["exists_calls"] += 1
        if self._client is None:
            return False
        try:
            res = await self._client.lookup(self._prompt(key), lease=False)
        except Exception as err:  # noqa: BLE001 -- failure is a miss
            self._failed("exists", err)
            return False
        hit = res.ok and res.kv_tokens > 0
        self.stats["exists_hits"] += hit
        return hit

    def exists_sync(self, key: CacheEngineKey) -> bool:
        try:
            running: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:  # waiting here would block the loop the answer needs
            log.warning("prefixstore LMCache exists_sync called on LMCache's loop thread; answering a miss")
            return False
        try:
            return asyncio.run_coroutine_threadsafe(self.exists(key), self.loop).result(
                self.settings.client.timeout_s * 2)
        except Exception as err:  # noqa: BLE001
            self._failed("exists", err)
            return False

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey], pin: bool = False) -> int:
        """How many of ``keys``, from the first, are stored (lookups in parallel)."""
        found = await asyncio.gather(*(self.exists(k) for k in keys))
        return found.index(False) if False in found else len(found)

    def support_batched_async_contains(self) -> bool:
        return True

    # ------------------------------------------------------------ reads

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        """The chunk as a MemoryObj from LMCache's CPU pool, or None (a miss)."""
        self.stats["gets"] += 1
        if self._client is None:
            return None
        try:
            obj = await self._get(key)
        except Exception as err:  # noqa: BLE001
            self._failed("get", err)
            return None
        if obj is None:
            self.stats["get_failures"] += 1
        else:
            self.stats["get_hits"] += 1
        return obj

    async def _get(self, key: CacheEngineKey) -> MemoryObj | None:
        assert self._client is not None and self.namespace is not None
        res = await self._client.lookup(self._prompt(key), lease=True)
        try:
            n = res.kv_tokens if res.ok else 0
            if not n:
                return None
            [(item, _, _)] = res.kv_reads(n)
            dtype = self.meta_dtypes[0]
            L = self.namespace.kv.num_layers
            staging = torch.empty((L, self._kv_size, n, self._hidden), dtype=dtype)
            [size] = await self._client.read([item], [staging.view(torch.uint8).numpy()])
        finally:
            await self._client.release(res.lease_id)
        if size != self.namespace.kv.payload_bytes(n):
            return None
        fmt = MemoryFormat.KV_MLA_FMT if self._kv_size == 1 else MemoryFormat.KV_2LTD
        obj = self.local_cpu_backend.allocate(torch.Size([self._kv_size, L, n, self._hidden]), dtype, fmt)
        if obj is None:
            log.warning("prefixstore LMCache get: LMCache's CPU pool is full; a miss")
            return None
        target = obj.tensor
        if target is None:
            obj.ref_count_down()
            return None
        target.copy_(staging.permute(1, 0, 2, 3))
        return obj

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return list(await asyncio.gather(*(self.get(k) for k in keys)))

    # ------------------------------------------------------------ writes

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        """Offer the chunk and put it if the store wants it; a failure drops the save."""
        self.stats["puts"] += 1
        if self._client is None:
            return
        try:
            await self._put(key, memory_obj)
        except Exception as err:  # noqa: BLE001
            self.stats["put_dropped"] += 1
            self._failed("put", err)

    async def _put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        assert self._client is not None
        tensor = memory_obj.tensor
        if tensor is None or tensor.dim() != 4 or tensor.shape[0] != self._kv_size \
                or tensor.shape[3] != self._hidden or tensor.dtype != self.meta_dtypes[0]:
            raise Unsupported(f"a chunk of shape {None if tensor is None else tuple(tensor.shape)} "
                              f"does not match the namespace")
        n = int(tensor.shape[2])
        payload = tensor.permute(1, 0, 2, 3).contiguous().view(torch.uint8).numpy().reshape(-1)
        result = await self._client.save(self._prompt(key, n), n, lambda a, b: payload)
        self.stats["put_stored"] += result.stored
        self.stats["put_dropped"] += result.dropped

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey], memory_objs: list[MemoryObj]) -> None:
        await asyncio.gather(*(self.put(k, m) for k, m in zip(keys, memory_objs)))

    # ------------------------------------------------------------ the rest of the interface

    def remove_sync(self, key: CacheEngineKey) -> bool:
        """Entries leave the store by its eviction, never by one engine's request (it is shared)."""
        return False

    async def list(self) -> list[str]:
        """The store lists no keys (entries are hashes; a tenant's are not enumerable)."""
        return []

    async def close(self) -> None:
        if self.prepared is not None:
            self.prepared.cancel()
        if self._client is not None:
            await self._client.close()
            self._client = None


__all__ = ["PLUGIN_TYPE", "PrefixStoreConnectorAdapter", "PrefixStoreRemoteConnector", "namespace_for"]
