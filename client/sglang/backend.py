"""The SGLang HiCache storage backend: SGLang uses prefixstore as its L3 tier.

Loaded by SGLang 0.5.x's own dynamic backend factory (no SGLang patch)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "prefixstore",
        "module_path": "prefixstore.client.sglang.backend", "class_name": "PrefixStoreHiCache",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true, "url": "http://store:8077"}'

``StorageBackendFactory`` imports the module, checks the class is a
``HiCacheStorage`` and builds it with the ``HiCacheStorageConfig``; the cache
controller then registers its host pools and calls, from its prefetch and
backup threads::

    batch_exists(keys)            one leaseless lookup  -> pages stored from the first key on
    batch_get_v1(keys, host_idx)  leased lookup + reads -> straight into the host pages
    batch_set_v1(keys, host_idx)  offer + put           <- gathered from the host pages
    batch_exists_v2 / _get_v2 / _set_v2   the same with the Mamba pool beside KV (hybrid models)

Keys: SGLang hands over page keys (SHA-256 chains over token ids), never the
tokens, so pages map onto the store's chain through their keys (keys.py).
``hicache_storage_pass_prefix_keys`` must be on: the store's chain starts at
the sequence's first page, and without the keys before a call's first key
there is no parent to chain from; every call is then a miss (warned once,
naming the knob).

Hybrid models (SGLang's HybridCacheController, Mamba / GDN state): SGLang
keeps one state per radix node, valid at the node's end, and hands it to the
backend with the key of the node's last page (``PoolName.MAMBA``,
``TRAILING_PAGES``). It becomes the store's snapshot at that page's end
boundary, registered in that page's block, so a lookup's ``state_tokens`` is
exactly the longest prefix with KV *and* state. SGLang backs up side pools
before KV, so a state whose page is not yet stored waits (copied) until the
KV save of the same backup stores the page (``max_pending_states``).

Failure is a miss, always: a store that is down, slow or answers wrongly
gives 0 pages found, False per page read or written, never an exception into
SGLang and never unverified bytes in its host pages (every payload is
checked against its xxh3 before it is scattered).
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from typing import Any

import sglang
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from prefixstore.protocol.errors import Reason
from prefixstore.protocol.namespace import Namespace, StateLayout
from prefixstore.protocol.wire import HAVE, STATUS_HAVE, STATUS_OK, WANT
from ..lru import BoundedLRU
from ..prompt import Prompt
from ..sync import SyncPrefixClient
from .keys import KEYSPACE, page_prompt
from ..heads import StateShards, gated_delta_net_shards, uniform_shards
from .pages import DTYPE_NAMES, HostKV, HostState, LayoutUnsupported
from .settings import BackendSettings

log = logging.getLogger(__name__)

STAT_KEYS = ("exists_calls", "pages_found", "pages_read", "pages_read_failed", "pages_written", "pages_refused",
             "states_found", "states_read", "states_written", "states_pending", "states_dropped", "errors")


def model_state_shards(model_path: str | None, mamba: Any) -> StateShards | None:
    """How the model's linear-layer state splits by heads (client/heads.py), from its Hugging Face
    config at ``model_path``, for the models whose state both engines lay out the same way: LFM2's
    short conv, Qwen3-Next's gated delta net. None (the state is then SGLang's own bytes, shared
    with no other engine) for any other model or a config that cannot be read."""
    if not model_path:
        return None
    try:
        from transformers import AutoConfig

        # SGLang has read this config before it registers host pools, so it is on disk (the model's
        # directory, or the Hub's cache): never asked of the network, where an offline host would
        # hold the engine's start in the Hub client's retries (about 23 s) for a name it lacks.
        config = AutoConfig.from_pretrained(model_path, local_files_only=True)
        conv_dtype = DTYPE_NAMES[mamba.conv_buffer[0].dtype]
        state_dtype = DTYPE_NAMES[mamba.temporal_buffer.dtype]
        if config.model_type == "lfm2":
            return uniform_shards(config.hidden_size, [((config.hidden_size, config.conv_L_cache - 1), conv_dtype)])
        if config.model_type == "qwen3_next":
            return gated_delta_net_shards(num_k_heads=config.linear_num_key_heads,
                                          num_v_heads=config.linear_num_value_heads,
                                          head_k_dim=config.linear_key_head_dim,
                                          head_v_dim=config.linear_value_head_dim,
                                          conv_width=config.linear_conv_kernel_dim, conv_dtype=conv_dtype,
                                          state_dtype=state_dtype)
    except Exception as err:  # noqa: BLE001 -- an unreadable config: the state stays SGLang's own bytes
        log.info("prefixstore HiCache backend: no head layout for %s's state (%s): SGLang's own bytes",
                 model_path, err)
    return None


class PrefixStoreHiCache(HiCacheStorage):
    """A ``HiCacheStorage`` over prefixstore's client (HTTP, or NIXL where both sides have it)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = BackendSettings.from_extra_config(storage_config.extra_config)
        self.stats: collections.Counter[str] = collections.Counter({k: 0 for k in STAT_KEYS})
        self.namespace: Namespace | None = None
        self.idle_reason: str | None = "no host pool registered yet"
        self._kv: HostKV | None = None
        self._state: HostState | None = None
        self._client: SyncPrefixClient | None = None
        self.prepared: concurrent.futures.Future[bool] | None = None
        """The client's data path set-up, started when the host pool is registered (whether payloads
        will take NIXL); None before."""
        # States waiting for their page; the oldest beyond max_pending_states is dropped (a future miss).
        self._pending: BoundedLRU[str, torch.Tensor] = BoundedLRU(self.settings.max_pending_states,
                                                                 on_evict=self._drop_pending)
        self._pending_lock = threading.Lock()
        self._warned: set[str] = set()

    # ------------------------------------------------------------ registration (SGLang's attach)

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    def on_host_pools_registered(self) -> None:
        """Every host pool is known: build the namespace and the client, or go idle with a reason."""
        try:
            self._attach()
        except LayoutUnsupported as err:
            self.idle_reason = str(err)
            log.warning("prefixstore HiCache backend idle (every call is a miss): %s", err)

    def _attach(self) -> None:
        cfg = self.storage_config
        if cfg.is_mla_model:
            raise LayoutUnsupported("MLA / rank-replicated KV (only MHA host pools are moved)")
        if cfg.attn_cp_size > 1 or cfg.dcp_size > 1 or cfg.should_split_heads:
            raise LayoutUnsupported("context-parallel or head-split storage shards")
        self._kv = HostKV.of(self.mem_pool_host)
        pools: dict[Any, Any] = getattr(self, "registered_pools", {})
        unsupported = [str(name) for name in pools if name not in (PoolName.KV, PoolName.MAMBA)]
        if unsupported:
            log.warning("prefixstore HiCache backend: pools %s are not moved; their loads miss", unsupported)
        mamba = pools.get(PoolName.MAMBA)
        state = StateLayout()
        revision = self.settings.revision + "|" + KEYSPACE
        if cfg.pp_size > 1:  # each stage holds its own layers
            revision += f"|pp:{cfg.pp_rank}/{cfg.pp_size}"
        if cfg.tp_size > 1:
            # The canonical layout names every head of a page, written whole by one writer; SGLang
            # hands each rank's backend its own heads and no group to gather them over (vLLM's
            # connector gathers to rank 0, client/vllm/tp.py), so a TP > 1 SGLang keeps one
            # namespace per rank: shared by SGLang fleets of the same TP size, by nothing else.
            revision += f"|tp:{cfg.tp_rank}/{cfg.tp_size}"
        model = self.settings.model_id or (cfg.model_name or "")
        if not model:
            raise ValueError("model_id: SGLang names no model here; set model_id in "
                             "--hicache-storage-backend-extra-config")
        if mamba is not None:
            try:
                self._state = HostState.of(mamba, model_state_shards(cfg.model_name, mamba)
                                           if cfg.tp_size == 1 else None)
            except LayoutUnsupported as err:
                log.warning("prefixstore HiCache backend: Mamba state not moved (loads of hybrid prefixes "
                            "miss): %s", err)
            else:
                state = self._state.layout
                if self._state.shards is None:
                    # SGLang's own state tensors: their meaning changes with its kernels.
                    revision += f"|state:sglang-{sglang.__version__}:{self._state.description()}"
        self.namespace = Namespace(model=model, revision=revision, kv=self._kv.layout, state=state,
                                   block_tokens=self._kv.page_tokens, tenant=self.settings.tenant)
        self._client = SyncPrefixClient(self.namespace, self.settings.client)
        # The data path set up while SGLang starts, on the client's thread: SGLang's first backup
        # then does not import nixl and make the agent, and a store that is down holds nothing up.
        self.prepared = self._client.prepare_in_background()
        self.idle_reason = None
        log.info("prefixstore HiCache backend: namespace %s (%s, page %d tokens, %d B/page%s)",
                 self.namespace.id_hex, model, self._kv.page_tokens, self._kv.page_bytes,
                 f", state {self._state.snapshot_bytes} B" if self._state else "")

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    # ------------------------------------------------------------ plumbing

    def _warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning("prefixstore HiCache backend: %s", message)

    def _chain(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None) -> tuple[Prompt, int] | None:
        """(the store's view of prefix + keys, number of prefix pages), or None (a miss) when the
        backend is idle or SGLang did not pass the prefix."""
        if self._client is None or self.namespace is None:
            return None
        prefix = extra_info.prefix_keys if extra_info is not None else None
        if prefix is None:
            self._warn_once("prefix", "SGLang passed no prefix keys, so every call is a miss: set "
                                      "\"hicache_storage_pass_prefix_keys\": true in "
                                      "--hicache-storage-backend-extra-config")
            return None
        return page_prompt(self.namespace, [*prefix, *keys]), len(prefix)

    def _failed(self, op: str, err: BaseException) -> None:
        """A bug or an unexpected input here is a miss too, never an exception into SGLang."""
        self.stats["errors"] += 1
        log.warning("prefixstore HiCache %s failed, treated as a miss: %s: %s", op, type(err).__name__, err)

    # ------------------------------------------------------------ KV pages (interface_v1)

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """How many of ``keys``, from the first, the store holds. One leaseless lookup: no side effect."""
        self.stats["exists_calls"] += 1
        try:
            chain = self._chain(keys, extra_info)
            if chain is None:
                return 0
            prompt, skip = chain
            found = self._found_pages(prompt, skip, len(keys))
            self.stats["pages_found"] += found
            return found
        except Exception as err:  # noqa: BLE001 -- failure is a miss
            self._failed("exists", err)
            return 0

    def _found_pages(self, prompt: Prompt, skip: int, n: int) -> int:
        assert self._client is not None
        res = self._client.lookup(prompt, lease=False)
        return max(0, min(res.matched_blocks - skip, n)) if res.ok else 0

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices``; True for each page now there."""
        try:
            return self._get_pages(keys, host_indices, extra_info)
        except Exception as err:  # noqa: BLE001
            self._failed("get", err)
            return [False] * len(keys)

    def _get_pages(self, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        chain = self._chain(keys, extra_info)
        if chain is None or not keys:
            return [False] * len(keys)
        assert self._client is not None and self._kv is not None
        prompt, skip = chain
        P = self._kv.page_tokens
        if host_indices.numel() != len(keys) * P:
            raise ValueError(f"{len(keys)} keys but {host_indices.numel()} host indices (page {P})")
        res = self._client.lookup(prompt, lease=True)
        try:
            usable = max(0, min(res.matched_blocks - skip, len(keys))) if res.ok else 0
            if not usable:
                return [False] * len(keys)
            reads = [item for item, s, _ in res.kv_reads((skip + usable) * P) if s >= skip * P]
            staging = self._kv.empty(usable)
            rows = staging.view(torch.uint8).reshape(usable, -1).numpy()
            sizes = self._client.read(reads, list(rows))
        finally:
            self._client.release(res.lease_id)
        ok = 0
        while ok < usable and sizes[ok] == self._kv.page_bytes:
            ok += 1
        if ok:  # only verified payloads reach SGLang's pages
            self._kv.scatter(host_indices[: ok * P], staging[:ok])
        self.stats["pages_read"] += ok
        self.stats["pages_read_failed"] += usable - ok
        return [True] * ok + [False] * (len(keys) - ok)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Offer the pages at ``host_indices`` and put what the store wants; True per page stored."""
        try:
            return self._set_pages(keys, host_indices, extra_info)
        except Exception as err:  # noqa: BLE001
            self._failed("set", err)
            return [False] * len(keys)

    def _set_pages(self, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> list[bool]:
        chain = self._chain(keys, extra_info)
        if chain is None or not keys:
            return [False] * len(keys)
        assert self._client is not None and self._kv is not None
        prompt, skip = chain
        P = self._kv.page_tokens
        if host_indices.numel() != len(keys) * P:
            raise ValueError(f"{len(keys)} keys but {host_indices.numel()} host indices (page {P})")
        pages = self._kv.gather(host_indices)
        rows = pages.view(torch.uint8).reshape(len(keys), -1).numpy()
        start = skip * P
        result = self._client.save(prompt, (skip + len(keys)) * P, lambda a, b: rows[(a - start) // P],
                                   start=start)
        # A refused page refuses every page after it (their parent is missing): the stored ones lead.
        ok = min(len(keys), result.stored + result.already)
        self.stats["pages_written"] += result.stored
        self.stats["pages_refused"] += len(keys) - ok
        for i in range(ok):
            self._flush_pending(keys[i], prompt, skip + i + 1)
        return [True] * ok + [False] * (len(keys) - ok)

    # ------------------------------------------------------------ pools beside KV (v2)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        """KV pages found, and (Mamba) the longest of them that also ends on a stored state."""
        self.stats["exists_calls"] += 1
        try:
            return self._exists_v2(keys, pool_transfers or [], extra_info)
        except Exception as err:  # noqa: BLE001
            self._failed("exists", err)
            return PoolTransferResult.empty()

    def _exists_v2(self, keys: list[str], transfers: list[PoolTransfer],
                   extra_info: HiCacheStorageExtraInfo | None) -> PoolTransferResult:
        chain = self._chain(keys, extra_info)
        if chain is None:
            return PoolTransferResult.empty()
        assert self._client is not None and self._kv is not None
        prompt, skip = chain
        res = self._client.lookup(prompt, lease=False)
        kv_pages = max(0, min(res.matched_blocks - skip, len(keys))) if res.ok else 0
        self.stats["pages_found"] += kv_pages
        hits: dict[str, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in transfers:
            if transfer.name == PoolName.MAMBA and transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES \
                    and len(transfer.keys or [""]) == 1 and self._state is not None:
                # The store's state_tokens: the largest snapshot boundary within the KV it matched.
                P = self._kv.page_tokens
                t = res.state_tokens
                pages = t // P - skip if t % P == 0 else 0
                restorable = [pages] if 0 < pages <= kv_pages else []
                if restorable:
                    hits[PoolName.MAMBA] = pages
                    self.stats["states_found"] += 1
            else:  # a pool this backend does not move: nothing of it is stored
                restorable = []
        final = restorable[-1] if restorable else 0
        return PoolTransferResult(final, hits, restorable)

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            try:
                if transfer.name == PoolName.KV and transfer.host_indices is not None:
                    out[transfer.name] = self._get_pages(keys, transfer.host_indices, extra_info)
                elif transfer.name == PoolName.MAMBA and len(keys) == 1 and transfer.host_indices is not None:
                    out[transfer.name] = [self._get_state(keys, transfer.host_indices, extra_info)]
                else:
                    out[transfer.name] = [False] * len(keys)
            except Exception as err:  # noqa: BLE001
                self._failed("get", err)
                out[transfer.name] = [False] * len(keys)
        return out

    def _get_state(self, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> bool:
        chain = self._chain(keys, extra_info)
        if chain is None or self._state is None:
            return False
        assert self._client is not None and self._kv is not None
        prompt, _ = chain
        boundary = prompt.num_tokens
        res = self._client.lookup(prompt, lease=True)
        try:
            item = res.state_read() if res.ok and res.state_tokens == boundary else None
            if item is None:
                return False
            staging = torch.empty(self._state.snapshot_bytes, dtype=torch.uint8)
            [size] = self._client.read([item], [staging.numpy()])
        finally:
            self._client.release(res.lease_id)
        if size != self._state.snapshot_bytes:
            return False
        self._state.scatter(int(host_indices.reshape(-1)[0]), staging)
        self.stats["states_read"] += 1
        return True

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            try:
                if transfer.name == PoolName.KV and transfer.host_indices is not None:
                    out[transfer.name] = self._set_pages(keys, transfer.host_indices, extra_info)
                elif transfer.name == PoolName.MAMBA and len(keys) == 1 and transfer.host_indices is not None:
                    out[transfer.name] = [self._set_state(keys, transfer.host_indices, extra_info)]
                else:
                    out[transfer.name] = [False] * len(keys)
            except Exception as err:  # noqa: BLE001
                self._failed("set", err)
                out[transfer.name] = [False] * len(keys)
        return out

    def _set_state(self, keys: list[str], host_indices: torch.Tensor,
                   extra_info: HiCacheStorageExtraInfo | None) -> bool:
        chain = self._chain(keys, extra_info)
        if chain is None or self._state is None:
            return False
        prompt, _ = chain
        payload = self._state.gather(int(host_indices.reshape(-1)[0])).reshape(-1)
        stored = self._save_state(prompt, payload)
        if stored is not None:
            return stored
        # The page this state ends is not stored yet: SGLang writes side pools before KV, and the KV
        # save of this same backup follows. Keep a copy until then (the host slot may be reused).
        with self._pending_lock:
            self.stats["states_pending"] += 1
            self._pending.put(keys[0], payload.clone())
        return True

    def _drop_pending(self, _: str, __: torch.Tensor) -> None:
        self.stats["states_dropped"] += 1

    def _save_state(self, prompt: Prompt, payload: torch.Tensor) -> bool | None:
        """Offer a snapshot at the prompt's end; True stored, False refused, None: its page is missing."""
        assert self._client is not None
        t = prompt.num_tokens
        spec = prompt.state_item(t, t)
        [decision] = self._client.offer([spec])
        if decision.status == HAVE:
            return True
        if decision.status == WANT:
            [put] = self._client.put([(spec, payload.numpy())])
            if put.status in (STATUS_OK, STATUS_HAVE):
                self.stats["states_written"] += 1
                return True
            return False
        return None if decision.reason is Reason.CONTAINER_MISSING else False

    def _flush_pending(self, key: str, prompt: Prompt, pages: int) -> None:
        """Save the state waiting for page ``key`` (the ``pages``-th of ``prompt``), now stored."""
        with self._pending_lock:
            payload = self._pending.pop(key, None)
        if payload is None:
            return
        chain = Prompt(prompt.namespace, prompt.tokens(0, pages * prompt.block_tokens), prompt.extra_keys[:pages])
        if not self._save_state(chain, payload):
            self.stats["states_dropped"] += 1

    # ------------------------------------------------------------ SGLang's copying interface (not used)

    def _copying(self) -> None:
        self._warn_once("copying", "SGLang called the copying get/set interface; set \"interface_v1\": 1 "
                                   "(every such call is a miss)")

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        self._copying()
        return None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        self._copying()
        return [None] * len(keys)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        self._copying()
        return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        self._copying()
        return False

    def exists(self, key: str) -> bool:
        """One key alone names no chain (its prefix is unknown): SGLang's batch calls are used instead."""
        return False

    def clear(self) -> None:
        """The store is shared by every engine of the namespace; clearing it is an operator's call
        (``prefixstore`` admin flush), never one SGLang instance's."""
        self._warn_once("clear", "clear() ignored: the store is shared (use the store's admin flush)")

    def get_stats(self) -> None:
        """SGLang's StorageMetrics are for backends that time their own transfers; this backend's
        counters are :attr:`stats` and the store's Prometheus metrics."""
        return None

    @property
    def failures(self) -> collections.Counter[str]:
        """The client's store failures by operation (empty while idle)."""
        return self._client.failures if self._client is not None else collections.Counter()

    @property
    def path_bytes(self) -> collections.Counter[str]:
        """Payload bytes moved by data path ('nixl', 'http'): which path the pages took."""
        return self._client.path_bytes if self._client is not None else collections.Counter()


__all__ = ["PrefixStoreHiCache", "STAT_KEYS"]
