"""The vLLM connector: vLLM engines use prefixstore as their remote prefix tier.

Loaded by vLLM (0.32, ``KVConnectorBase_V1``) through::

    --kv-transfer-config '{"kv_connector": "PrefixStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "prefixstore.client.vllm.connector",
        "kv_connector_extra_config": {"url": "http://store:8077", "mode": "exact"}}'

One class, two roles (vLLM builds one object per role)::

    scheduler                                      worker
    get_num_new_matched_tokens  one lookup         register_kv_caches  views -> VllmKV, staging region
    update_state_after_alloc    -> load plan       start_load_kv       loads start on the client loop
    request_finished(_all_groups) -> save plan,    wait_for_layer_load layer i in place (sync loads)
        blocks held until the worker copied them   save_kv_layer       nothing: saves read the blocks
    build_connector_meta        both plans         wait_for_save       gather finished requests, offer
                                                   get_finished / get_block_ids_with_load_errors

Loads. The scheduler's lookup is of the prompt less its last token (whose
logits are the answer), without a lease: ``get_num_new_matched_tokens`` has no
side effect, on the store either. An entry evicted before the worker reads it
is a failed load, reported to vLLM, which recomputes. Tiers are compared in
tokens: the count returned is the store's reusable length minus the engine's
local hit (vLLM hands the local hit rounded down to its block), so a store
hit that ends mid-block is used to the exact token.

* Plain transformers: KV up to ``kv_tokens``, loaded synchronously and layer
  by layer (vLLM's attention layers call ``wait_for_layer_load``). A failed
  read marks the request's loaded blocks in ``get_block_ids_with_load_errors``;
  vLLM truncates the request there and recomputes.
* Hybrid models (Mamba / GDN groups beside attention): KV and state up to the
  store's state boundary ``state_tokens`` (exact reuse), which must fall on a
  vLLM block boundary: in ``mamba_cache_mode="align"`` (the mode vLLM's prefix
  caching of hybrid models uses) the state after ``n`` tokens lives in the
  Mamba block at position ``n // block_size - 1``. These loads are
  asynchronous: vLLM 0.32 cannot map block-level load errors back to requests
  when there is more than one KV cache group (it raises), so a failure is
  reported per request through ``get_transfer_results().failed_recving``.
  Tail-Replay ('replay') would need the engine to rebuild the state by
  replaying a suffix; vLLM cannot, so it is refused at start-up.

Saves, twice per request. (1) In the step whose forward pass completes a
prompt, ``build_connector_meta`` plans a save of the prompt's KV; the worker's
``wait_for_save`` (after that forward pass) copies it out of the blocks. (2)
``request_finished`` plans a save of everything the request computed
(``num_computed_tokens``: prompt plus all but the last sampled token: the next
turn of a conversation replays it) and keeps its blocks; the worker's next
``wait_for_save`` copies them and reports the request in ``get_finished`` so
vLLM frees the blocks. The next step may be the next request's, which is why
(1) exists: a request arriving right after another finished would otherwise
look up before the finished one's save started. Either way the copy is all
the engine waits for: offer and put run on the client's own loop, and only
what the store wants is sent.

The store is best effort: a store that is down or slow gives misses (0
tokens) and dropped saves, counted in the stats, never an exception in the
engine and never wrong bytes (checksums, zeroed staging, failed loads
recomputed). Requests the namespace cannot key safely (multimodal inputs,
LoRA, prompt embeddings) are neither loaded nor saved.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ...protocol.namespace import KVLayout, Namespace, StateLayout
from ..client import PrefixClient
from ..results import LookupResult
from ..sync import SyncPrefixClient
from .layout import DTYPE_NAMES, AttentionLayer, LayoutUnsupported, VllmKV, check_cpu_layout
from .settings import ConnectorSettings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from ...gpu_staging.staging import StagingBuffer

log = logging.getLogger(__name__)

#: GPU attention backends that keep a token's K then V at [block, head, slot, :] of vLLM's view.
TOKEN_MAJOR_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})


# ---------------------------------------------------------------- what the cache groups hold


@dataclass(frozen=True, kw_only=True)
class CacheGroups:
    """Which KV cache groups the connector moves: attention groups (KV) and Mamba groups (state)."""

    attention: tuple[tuple[int, tuple[str, ...], int], ...]
    """(group id, layer names, block size) of every full-attention group."""
    mamba: tuple[tuple[int, tuple[str, ...], int], ...] = ()
    """(group id, layer names, block size) of every Mamba group."""
    kv: KVLayout
    state: StateLayout

    @property
    def hybrid(self) -> bool:
        return bool(self.mamba)

    @property
    def state_block_tokens(self) -> int:
        """The token grid snapshots live on in vLLM (the Mamba groups' block size)."""
        return self.mamba[0][2] if self.mamba else 0

    @classmethod
    def of(cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> CacheGroups:
        """Raises LayoutUnsupported for caches this connector does not move (it then stays idle)."""
        from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec

        attention: list[tuple[int, tuple[str, ...], int]] = []
        mamba: list[tuple[int, tuple[str, ...], int]] = []
        att_spec: Any = None
        state_bytes: set[int] = set()
        for gid, group in enumerate(kv_cache_config.kv_cache_groups):
            spec = group.kv_cache_spec
            names = tuple(group.layer_names)
            if isinstance(spec, MambaSpec):
                mamba.append((gid, names, spec.block_size))
                state_bytes.add(spec.num_heads * spec.get_num_kernel_states(spec.block_size)
                                * spec.state_content_size_bytes)
            elif (isinstance(spec, FullAttentionSpec) and not isinstance(spec, MLAAttentionSpec)
                  and getattr(spec, "sliding_window", None) is None and spec.head_size == spec.head_size_v):
                if att_spec is not None and (spec.num_kv_heads, spec.head_size, spec.dtype) != (
                        att_spec.num_kv_heads, att_spec.head_size, att_spec.dtype):
                    raise LayoutUnsupported("attention groups of different head shapes or dtypes")
                att_spec = spec
                attention.append((gid, names, spec.block_size))
            else:
                raise LayoutUnsupported(f"KV cache group {gid} holds {type(spec).__name__} "
                                        "(only full attention and Mamba state are moved)")
        if att_spec is None:
            raise LayoutUnsupported("no full-attention layer")
        if att_spec.dtype not in DTYPE_NAMES:
            raise LayoutUnsupported(f"KV dtype {att_spec.dtype}")
        if mamba:
            if getattr(vllm_config.cache_config, "mamba_cache_mode", "none") != "align":
                raise LayoutUnsupported("a hybrid model's state is moved only with mamba_cache_mode='align' "
                                        "(vLLM keeps no per-block state otherwise)")
            if len(state_bytes) != 1 or len({bs for _, _, bs in mamba}) != 1:
                raise LayoutUnsupported("Mamba groups of different state sizes or block sizes")
        num_state_layers = sum(len(names) for _, names, _ in mamba)
        return cls(
            attention=tuple(attention), mamba=tuple(mamba),
            kv=KVLayout(num_layers=sum(len(names) for _, names, _ in attention), num_heads=att_spec.num_kv_heads,
                        head_dim=att_spec.head_size, dtype=DTYPE_NAMES[att_spec.dtype]),
            state=StateLayout(num_layers=num_state_layers, shapes=((state_bytes.pop(),),), dtype="uint8")
            if mamba else StateLayout())


def namespace_for(vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings,
                  tp_rank: int) -> Namespace:
    """The namespace both roles key entries under (they must build the same one)."""
    import vllm

    model = vllm_config.model_config
    name = settings.model_id or (str(model.model) if model is not None else "")
    if not name:
        raise ValueError("model_id: vLLM names no model here; set model_id in kv_connector_extra_config")
    revision = str(getattr(model, "revision", None) or "")
    if groups.hybrid:
        # Snapshot bytes are vLLM's own state blocks: their meaning changes with vLLM's kernels.
        revision += f"|state:vllm-{vllm.__version__}"
    return Namespace(model=name, revision=revision, kv=groups.kv,
                     state=groups.state, tp_rank=tp_rank, tp_size=vllm_config.parallel_config.tensor_parallel_size,
                     block_tokens=settings.block_tokens, tenant=settings.tenant)


# ---------------------------------------------------------------- plans (scheduler -> worker)


@dataclass(frozen=True, kw_only=True)
class LoadPlan:
    req_id: str
    lookup: LookupResult
    start: int
    """First token to write (the engine's local hit ends here)."""
    end: int
    block_ids: tuple[list[int], ...]
    state_index: int | None = None
    """Position of the Mamba block the snapshot at ``end`` goes to (hybrid only)."""
    is_async: bool = False


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    req_id: str
    tokens: list[int]
    """The tokens whose KV the request computed."""
    start: int
    """Store-block-aligned start: the blocks before it came from the store."""
    block_ids: tuple[list[int], ...]
    snapshot: int = 0
    """Boundary of the snapshot to save (0: none)."""
    extra_keys: list[bytes] = field(default_factory=list)
    hold: bool = False
    """The request finished and vLLM keeps its blocks until the worker reports it (get_finished);
    a prompt-end save runs in the step that computed the prompt, while the request still owns them."""


@dataclass
class PrefixStoreMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


# ---------------------------------------------------------------- stats


STAT_KEYS = ("lookups", "lookup_failures", "query_tokens", "kv_hit_tokens", "state_hit_tokens", "loaded_tokens",
             "load_failures", "loaded_bytes", "saves", "saved_items", "saved_bytes", "dropped_items",
             "skipped_requests")


@dataclass
class PrefixStoreStats(KVConnectorStats):
    """Counters since the last report. KV and state hits are separate: the failure signature
    operators look for is a healthy KV hit rate with a collapsed state hit rate (DESIGN §10)."""

    def __post_init__(self) -> None:
        for key in STAT_KEYS:
            self.data.setdefault(key, 0)

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n

    def reset(self) -> None:
        self.data = {key: 0 for key in STAT_KEYS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for key, value in other.data.items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = dict(self.data)
        if self.data["query_tokens"]:
            out["kv_hit_rate"] = round(self.data["kv_hit_tokens"] / self.data["query_tokens"], 4)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


class PrefixStorePromMetrics(KVConnectorPromMetrics):
    """``prefixstore_vllm_*_total`` counters per engine (vLLM adds its model/engine labels)."""

    def __init__(self, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        tokens = self._counter_cls(name="prefixstore_vllm_lookup_tokens_total",
                                   documentation="Prompt tokens looked up in prefixstore, by kind and result.",
                                   labelnames=[*labelnames, "kind", "result"])
        self._tokens: dict[tuple[int, str, str], Any] = {
            (idx, kind, result): tokens.labels(*values, kind, result)
            for idx, values in per_engine_labelvalues.items() for kind in ("kv", "state") for result in ("hit", "miss")}
        events = self._counter_cls(name="prefixstore_vllm_events_total",
                                   documentation="Connector events: lookups, lookup_failures, load_failures, saves, "
                                                 "saved_items, dropped_items, skipped_requests.",
                                   labelnames=[*labelnames, "event"])
        self._events_keys = ("lookups", "lookup_failures", "load_failures", "saves", "saved_items", "dropped_items",
                             "skipped_requests")
        self._events: dict[tuple[int, str], Any] = {
            (idx, key): events.labels(*values, key)
            for idx, values in per_engine_labelvalues.items() for key in self._events_keys}
        moved = self._counter_cls(name="prefixstore_vllm_transfer_bytes_total",
                                  documentation="Payload bytes moved between vLLM and prefixstore.",
                                  labelnames=[*labelnames, "direction"])
        self._bytes: dict[tuple[int, str], Any] = {
            (idx, d): moved.labels(*values, d)
            for idx, values in per_engine_labelvalues.items() for d in ("load", "save")}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        d = transfer_stats_data
        q = d.get("query_tokens", 0)
        for kind, hits in (("kv", d.get("kv_hit_tokens", 0)), ("state", d.get("state_hit_tokens", 0))):
            self._tokens[(engine_idx, kind, "hit")].inc(hits)
            self._tokens[(engine_idx, kind, "miss")].inc(max(q - hits, 0))
        for key in self._events_keys:
            self._events[(engine_idx, key)].inc(d.get(key, 0))
        self._bytes[(engine_idx, "load")].inc(d.get("loaded_bytes", 0))
        self._bytes[(engine_idx, "save")].inc(d.get("saved_bytes", 0))


# ---------------------------------------------------------------- the client's loop (worker)


class _Loop:
    """A private event loop on a daemon thread: loads and saves run there while the engine computes."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="prefixstore-vllm", daemon=True)
        self._thread.start()

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self, client: PrefixClient | None) -> None:
        if client is not None:
            try:
                self.submit(client.close()).result(timeout=10)
            except Exception as err:  # noqa: BLE001 -- shutting down: nothing left to protect
                log.debug("prefixstore client close: %s", err)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)


class _LoadFailed(Exception):
    pass


# ---------------------------------------------------------------- the connector


class PrefixStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """prefixstore as vLLM's remote KV (and hybrid state) tier. See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = ConnectorSettings.from_extra_config(extra)
        self.stats = PrefixStoreStats()
        self.groups: CacheGroups | None = None
        try:
            self.groups = CacheGroups.of(vllm_config, kv_cache_config)
        except LayoutUnsupported as err:
            log.warning("prefixstore connector idle (never loads or saves): %s", err)
        if self.groups is not None and self.groups.hybrid and self.settings.mode == "replay":
            raise ValueError("mode: 'replay' (Tail-Replay) needs an engine that rebuilds recurrent state by "
                             "replaying a suffix; vLLM cannot, so use 'exact' on this hybrid model")
        # Scheduler side.
        self._client: SyncPrefixClient | None = None
        self._lookups: dict[str, tuple[LookupResult, int]] = {}  # req -> (lookup, local hit) of the latest query
        self._store_start: dict[str, int] = {}  # req -> tokens loaded from the store, block-aligned (save start)
        self._loads: list[LoadPlan] = []
        self._saves: list[SavePlan] = []
        self._requests: dict[str, Request] = {}  # live requests (on_new_request .. finished)
        self._saved_upto: dict[str, int] = {}  # req -> tokens a prompt-end save covered
        # Worker side.
        self._kv: VllmKV | None = None
        self._staging: StagingBuffer | None = None
        self._loop: _Loop | None = None
        self._worker_client: PrefixClient | None = None
        self._load_lock: asyncio.Lock | None = None
        self._layer_index: dict[str, int] = {}
        self._events: list[threading.Event] | None = None
        self._sync_load: concurrent.futures.Future[dict[str, str]] | None = None
        self._sync_plans: list[LoadPlan] = []
        self._failed_blocks: set[int] = set()
        self._async_loads: list[tuple[LoadPlan, concurrent.futures.Future[dict[str, str]]]] = []
        self._done_sending: set[str] = set()
        self._saves_in_flight: list[concurrent.futures.Future[Any]] = []
        self._stats_lock = threading.Lock()

    # ------------------------------------------------------------ shared

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    def _namespace(self, tp_rank: int) -> Namespace:
        assert self.groups is not None
        return namespace_for(self._vllm_config, self.groups, self.settings, tp_rank)

    def _count(self, key: str, n: int = 1) -> None:
        with self._stats_lock:
            self.stats.add(key, n)

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._stats_lock:
            if self.stats.is_empty():
                return None
            out, self.stats = self.stats, PrefixStoreStats()
            return out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PrefixStoreStats(data=dict(data)) if data is not None else PrefixStoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return PrefixStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the worker's saves and asynchronous loads in flight (shutdown; tests). Their
        outcomes are reported as usual: loads through get_transfer_results, saves in the stats."""
        pending = [*self._saves_in_flight, *(fut for _, fut in self._async_loads)]
        concurrent.futures.wait(pending, timeout=timeout_s if timeout_s is not None
                                else 4 * self.settings.client.timeout_s)

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._loop is not None:
            self.drain()
            self._loop.close(self._worker_client)
            self._loop = self._worker_client = None

    # ------------------------------------------------------------ scheduler side

    @staticmethod
    def _keyable(request: Request) -> bool:
        """Whether the token ids alone identify this request's KV (else: neither load nor save)."""
        return (not request.mm_features and request.lora_request is None
                and getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None)

    @staticmethod
    def _extra_keys(request: Request) -> list[bytes]:
        # vLLM isolates prefix caching by cache_salt; so does the store: the salt keys block 0, and
        # every later block chains from it.
        salt = getattr(request, "cache_salt", None)
        return [b"salt:" + salt.encode()] if salt else []

    def _scheduler_client(self) -> SyncPrefixClient:
        if self._client is None:
            self._client = SyncPrefixClient(self._namespace(0), self.settings.client)
        return self._client

    def loadable_tokens(self, lookup: LookupResult) -> int:
        """How much of a lookup the engine can take: KV alone on a plain transformer; on a hybrid
        model the state boundary (exact), which must lie on vLLM's state grid."""
        assert self.groups is not None
        if not lookup.ok:
            return 0
        if not self.groups.hybrid or self.settings.mode == "replay":
            return lookup.kv_tokens
        t = lookup.state_tokens
        return t if t % self.groups.state_block_tokens == 0 else 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup, no side effect; the tokens the store adds beyond the engine's local hit."""
        memo = self._lookups.pop(request.request_id, None)
        if self.groups is None or not self.settings.load or not self._keyable(request):
            return 0, False
        tokens = request.all_token_ids[: request.num_tokens - 1]  # the last token is always computed
        if len(tokens) <= num_computed_tokens:
            return 0, False
        if memo is not None and memo[0].ok and memo[0].num_tokens == len(tokens):
            # Asked again (the request did not fit this step): the same answer, without another
            # lookup, which the store's admission would count as a second sighting of the prefix.
            lookup = memo[0]
        else:
            client = self._scheduler_client()
            lookup = client.lookup(client.prompt(tokens, self._extra_keys(request)), lease=False)
        self._lookups[request.request_id] = (lookup, num_computed_tokens)
        extra = self.loadable_tokens(lookup) - num_computed_tokens
        if extra <= 0:
            return 0, False
        return extra, self.groups.hybrid

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        memo = self._lookups.pop(request.request_id, None)
        if memo is None:
            return
        lookup, local = memo
        self._count("lookups")
        if not lookup.ok:
            self._count("lookup_failures")
        assert self.groups is not None
        query = lookup.num_tokens - local
        self._count("query_tokens", max(query, 0))
        self._count("kv_hit_tokens", max(min(lookup.kv_tokens - local, query), 0))
        if num_external_tokens <= 0:
            return
        end = local + num_external_tokens
        state_index = None
        if self.groups.hybrid:
            self._count("state_hit_tokens", num_external_tokens)
            state_index = end // self.groups.state_block_tokens - 1
        B = self.settings.block_tokens
        self._store_start[request.request_id] = min(lookup.matched_blocks, end // B) * B
        self._loads.append(LoadPlan(req_id=request.request_id, lookup=lookup, start=local, end=end,
                                    block_ids=blocks.get_block_ids(), state_index=state_index,
                                    is_async=self.groups.hybrid))

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """This step's loads, finished requests' saves, and a save of every prompt whose prefill
        this step completes (the worker gathers it after the forward pass that wrote it). Saving at
        the prompt end, not only at the finish, is what lets the next request sharing the prompt
        hit: a finished request's save waits for the engine's next step."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_prompt_save(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_prompt_save(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        meta = PrefixStoreMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        return meta

    def _plan_prompt_save(self, req_id: str, computed_after_step: int) -> None:
        request = self._requests.get(req_id)
        if (request is None or req_id in self._saved_upto or self._kv_cache_manager is None
                or computed_after_step < request.num_prompt_tokens):
            return
        self._saved_upto[req_id] = 0
        plan = self._save_plan(request, request.num_prompt_tokens,
                               self._kv_cache_manager.get_block_ids(req_id), hold=False)
        if plan is not None:
            self._saved_upto[req_id] = len(plan.tokens)
            self._saves.append(plan)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request, block_ids)

    def _finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of what the request computed; True keeps its blocks until the worker copied them."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._requests.pop(req_id, None)
        saved = self._saved_upto.pop(req_id, 0)
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        plan = self._save_plan(request, computed, block_ids, hold=True)
        self._store_start.pop(req_id, None)
        if plan is None or len(plan.tokens) <= saved:
            return False, None  # nothing beyond what the prompt-end save covered
        self._saves.append(plan)
        return True, None

    def _save_plan(self, request: Request, computed: int, block_ids: tuple[list[int], ...], *, hold: bool
                   ) -> SavePlan | None:
        """A save of the request's KV [0, computed) (and, on a hybrid model, the snapshot that ends it)."""
        if self.groups is None or not self.settings.save:
            return None
        if not self._keyable(request):
            self._count("skipped_requests")
            return None
        start = self._store_start.get(request.request_id, 0)
        snapshot = 0
        if self.groups.hybrid:
            grid = self.groups.state_block_tokens
            snapshot = computed // grid * grid
            index = snapshot // grid - 1
            if snapshot and any(index >= len(block_ids[g]) or block_ids[g][index] == 0
                                for g, _, _ in self.groups.mamba):
                snapshot = 0  # that state block is gone (vLLM keeps only the latest ones)
            computed = snapshot  # KV beyond the last snapshot is useless without its state in exact mode
        if computed < 1:
            return None
        return SavePlan(req_id=request.request_id, tokens=list(request.all_token_ids[:computed]),
                        start=min(start, computed), block_ids=tuple(list(b) for b in block_ids),
                        snapshot=snapshot, extra_keys=self._extra_keys(request), hold=hold)

    # ------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's KV views; allocate the staging region once."""
        if self.groups is None:
            return
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        from ...gpu_staging.staging import StagingBuffer

        try:
            tp_rank = get_tensor_model_parallel_rank()
        except Exception:  # noqa: BLE001 -- no model-parallel group (a test, one process)
            tp_rank = 0
        try:
            names = [name for _, group_names, _ in self.groups.attention for name in group_names]
            token_layout = self._token_layout(names)
            attention = [AttentionLayer(name=name, view=kv_caches[name], block_size=bs, group=gid,
                                        token_layout=token_layout)
                         for gid, group_names, bs in self.groups.attention for name in group_names]
            if token_layout == "cpu_attn":
                check_cpu_layout(attention[0])
            state = [(gid, kv_caches[name]) for gid, group_names, _ in self.groups.mamba for name in group_names]
            kv = VllmKV(attention, state)
            ns = self._namespace(tp_rank)
            if kv.layer_token_bytes != ns.kv.layer_token_bytes or kv.snapshot_bytes != ns.state.snapshot_bytes:
                raise LayoutUnsupported("the registered views do not match the KV cache config")
        except (KeyError, LayoutUnsupported) as err:
            log.warning("prefixstore connector idle (never loads or saves): %s", err)
            self.groups = None
            return
        self._kv = kv
        self._layer_index = {layer.name: i for i, layer in enumerate(attention)}
        self._staging = StagingBuffer(self.settings.staging_bytes, attention[0].view.device)
        self._loop = _Loop()
        self._worker_client = PrefixClient(ns, self.settings.client)
        # NIXL path (data_path auto/nixl, the store serving it): the staging region is registered with
        # the client's agent once, so every load READs straight into it; a no-op over HTTP.
        self._staging.register_with(self._worker_client)

        async def make_lock() -> asyncio.Lock:
            return asyncio.Lock()

        self._load_lock = self._loop.submit(make_lock()).result()

    def _token_layout(self, names: Sequence[str]) -> str:
        """Where a token's K and V sit inside a block: fixed by the attention backend, not by vLLM's
        view (layout.py). Unknown backends make the connector idle rather than guess."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu_attn"
        context = self._vllm_config.compilation_config.static_forward_context
        backends = {context[n].attn_backend.get_name() for n in names
                    if n in context and hasattr(context[n], "attn_backend")}
        if backends and backends <= TOKEN_MAJOR_BACKENDS:
            return "token_major"
        raise LayoutUnsupported(f"attention backend {sorted(backends) or 'unknown'}: its block layout is not "
                                f"known to this connector (known: {sorted(TOKEN_MAJOR_BACKENDS)}, CPU_ATTN)")

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Start this step's loads on the client loop; sync loads release layers one by one."""
        if self._loop is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixStoreMetadata)
        sync = [p for p in meta.loads if not p.is_async]
        for plan in (p for p in meta.loads if p.is_async):
            self._async_loads.append((plan, self._loop.submit(self._load([plan], None))))
        if sync:
            assert self._kv is not None
            self._events = [threading.Event() for _ in self._kv.attention]
            self._sync_plans = sync
            self._sync_load = self._loop.submit(self._load(sync, self._events))

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if self._events is not None and index is not None:
            self._events[index].wait()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: a finished request's blocks stay allocated until wait_for_save has
        copied them, so the save reads all layers there at once."""

    def wait_for_save(self) -> None:
        """Finish this step's sync loads (their failures are reported with this step); copy
        finished requests' payloads out of their blocks and offer them on the client loop."""
        if self._sync_load is not None:
            failures = self._sync_load.result()
            for plan in self._sync_plans:
                if plan.req_id in failures:
                    self._failed_blocks.update(self._blocks_of(plan))
            self._sync_load, self._events, self._sync_plans = None, None, []
        if self._loop is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixStoreMetadata)
        for save in meta.saves:
            try:
                self._start_save(save)
            except Exception as err:  # noqa: BLE001 -- best effort: a save never fails the engine
                log.warning("prefixstore save of %s dropped: %s: %s", save.req_id, type(err).__name__, err)
                self._count("dropped_items")
            if save.hold:
                self._done_sending.add(save.req_id)  # its blocks have been copied (or will never be)

    def _blocks_of(self, plan: LoadPlan) -> set[int]:
        """Blocks of the attention groups holding tokens [start, end) of a load."""
        assert self.groups is not None
        out: set[int] = set()
        for gid, _, bs in self.groups.attention:
            out.update(plan.block_ids[gid][plan.start // bs : -(-plan.end // bs)])
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, self._done_sending = self._done_sending, set()
        recving: set[str] = set()
        failed: set[str] = set()
        still: list[tuple[LoadPlan, concurrent.futures.Future[dict[str, str]]]] = []
        for plan, fut in self._async_loads:
            if not fut.done():
                still.append((plan, fut))
                continue
            recving.add(plan.req_id)
            if fut.result():
                failed.add(plan.req_id)
        self._async_loads = still
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    # ------------------------------------------------------------ loads (client loop)

    async def _load(self, plans: Sequence[LoadPlan], events: list[threading.Event] | None) -> dict[str, str]:
        """Load every plan, layer by layer; returns req -> why its load failed. Never raises, and
        always releases every layer event."""
        assert self._kv is not None and self._load_lock is not None
        failures: dict[str, str] = {}
        try:
            async with self._load_lock:  # one staging region: loads of different steps take turns
                tables = {p.req_id: [torch.tensor(ids, dtype=torch.long) for ids in p.block_ids] for p in plans}
                plans = [await self._relookup(plan, failures) for plan in plans]
                for plan in plans:
                    if plan.state_index is not None and plan.req_id not in failures:
                        await self._guarded(plan, failures, self._load_state(plan))
                for layer in range(len(self._kv.attention)):
                    for plan in plans:
                        if plan.req_id not in failures:
                            await self._guarded(plan, failures, self._load_layer(plan, tables[plan.req_id], layer))
                    if events is not None:
                        events[layer].set()
                for plan in plans:
                    await self._worker_client.release(plan.lookup.lease_id)  # type: ignore[union-attr]
        finally:
            if events is not None:
                for event in events:
                    event.set()
        for plan in plans:
            if plan.req_id in failures:
                self._count("load_failures")
            else:
                self._count("loaded_tokens", plan.end - plan.start)
        return failures

    async def _relookup(self, plan: LoadPlan, failures: dict[str, str]) -> LoadPlan:
        """The worker's own lookup, leased, before it reads: the scheduler's was lease-free (no side
        effects), and a cluster client reads each entry from the node its own lookup found it on.
        A store that lost part of the prefix meanwhile fails the load (vLLM recomputes), never
        serves a shorter one as if it were whole."""
        assert self._worker_client is not None
        lookup = await self._worker_client.lookup(plan.lookup.prompt, lease=True)
        if not lookup.ok or lookup.kv_tokens < plan.end or (plan.state_index is not None
                                                             and lookup.state_tokens != plan.end):
            failures[plan.req_id] = (f"the store now holds kv={lookup.kv_tokens} state={lookup.state_tokens} "
                                     f"(ok={lookup.ok}), the load needs {plan.end}")
            log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id, failures[plan.req_id])
            await self._worker_client.release(lookup.lease_id)
        return dataclasses.replace(plan, lookup=lookup)

    async def _guarded(self, plan: LoadPlan, failures: dict[str, str], step: Any) -> None:
        try:
            await step
        except Exception as err:  # noqa: BLE001 -- any failure is a miss that vLLM recomputes
            failures[plan.req_id] = f"{type(err).__name__}: {err}"
            log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id, failures[plan.req_id])

    async def _load_layer(self, plan: LoadPlan, tables: list[torch.Tensor], layer: int) -> None:
        assert self._kv is not None and self._staging is not None and self._worker_client is not None
        lookup = plan.lookup
        B = lookup.prompt.block_tokens
        child = lookup.child
        reads = [(item, s, e) for item, s, e in lookup.kv_reads(plan.end, layer, layer + 1) if e > plan.start]
        payload_tokens = [child.num_tokens if child is not None and item.key == child.key else B
                          for item, _, _ in reads]
        sizes = [n * self._kv.layer_token_bytes for n in payload_tokens]
        for batch in self._staging.rounds(sizes):
            slots = self._staging.carve([sizes[i] for i in batch])
            # NIXL READs land in the device slots; the rest through the host. Zeroes what nothing covered.
            filled = await self._staging.receive(self._worker_client, [reads[i][0] for i in batch], slots)
            if not all(filled):
                raise _LoadFailed(f"KV layer {layer}: {filled.count(False)} of {len(filled)} payloads missing")
            for i, slot in zip(batch, slots):
                _, s, e = reads[i]
                self._kv.scatter_layer(layer, self._staging.region[slot.offset : slot.end], tables, s,
                                       payload_tokens[i], max(s, plan.start), e)
            self._count("loaded_bytes", sum(s.nbytes for s in slots))

    async def _load_state(self, plan: LoadPlan) -> None:
        assert self._kv is not None and self._staging is not None and self._worker_client is not None
        assert self.groups is not None and plan.state_index is not None
        item = plan.lookup.state_read()
        if item is None or plan.lookup.state_tokens != plan.end:
            raise _LoadFailed(f"no snapshot at {plan.end}")
        if plan.state_index < 0 or any(plan.block_ids[g][plan.state_index] == 0 for g, _, _ in self.groups.mamba):
            raise _LoadFailed("no state block allocated at the boundary")
        [slot] = self._staging.carve([self._kv.snapshot_bytes])
        if not (await self._staging.receive(self._worker_client, [item], [slot]))[0]:
            raise _LoadFailed(f"snapshot at {plan.end} could not be read")
        self._kv.scatter_state(self._staging.region[slot.offset : slot.end], plan.block_ids, plan.state_index)
        self._count("loaded_bytes", slot.nbytes)

    # ------------------------------------------------------------ saves

    def _start_save(self, plan: SavePlan) -> None:
        """Copy the plan's payloads out of the blocks (now), offer and put them (on the loop)."""
        assert self._kv is not None and self._loop is not None and self._worker_client is not None
        client = self._worker_client
        prompt = client.prompt(plan.tokens, plan.extra_keys)
        T = len(plan.tokens)
        B = prompt.block_tokens
        start = plan.start - plan.start % B
        items = prompt.kv_items(T, start)
        tables = [torch.tensor(ids, dtype=torch.long) for ids in plan.block_ids]
        device = self._kv.attention[0].view.device
        total = sum(spec.size for spec, _, _ in items)
        host = torch.empty(total + self._kv.snapshot_bytes * bool(plan.snapshot), dtype=torch.uint8, device=device)
        offsets: dict[tuple[int, int], tuple[int, int]] = {}
        pos = 0
        for spec, a, b in items:
            self._kv.gather(host[pos : pos + spec.size], tables, a, b)
            offsets[(a, b)] = (pos, pos + spec.size)
            pos += spec.size
        snapshots = {}
        if plan.snapshot:
            assert self.groups is not None
            self._kv.gather_state(host[pos:], plan.block_ids, plan.snapshot // self.groups.state_block_tokens - 1)
        host_np = host.cpu().numpy()
        if plan.snapshot:
            snapshots[plan.snapshot] = host_np[pos:]

        put_bytes = 0

        def payload(a: int, b: int) -> Any:
            nonlocal put_bytes
            lo, hi = offsets[(a, b)]
            put_bytes += hi - lo
            return host_np[lo:hi]

        async def save() -> None:
            result = await client.save(prompt, T, payload, snapshots, start)
            self._count("saves")
            self._count("saved_items", result.stored)
            self._count("dropped_items", result.dropped)
            self._count("saved_bytes", put_bytes if result.stored else 0)

        self._saves_in_flight = [f for f in self._saves_in_flight if not f.done()]
        self._saves_in_flight.append(self._loop.submit(save()))


__all__ = ["CacheGroups", "LoadPlan", "PrefixStoreConnector", "PrefixStoreMetadata", "PrefixStoreStats",
           "SavePlan", "namespace_for"]
