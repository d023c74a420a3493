"""The vLLM connector: vLLM engines use prefixstore as their remote prefix tier.

Loaded by vLLM (0.32, ``KVConnectorBase_V1``) through::

    --kv-transfer-config '{"kv_connector": "PrefixStoreConnector", "kv_role": "kv_both",
        "kv_connector_module_path": "prefixstore.client.vllm.connector",
        "kv_connector_extra_config": {"url": "http://store:8077", "mode": "exact"}}'

vLLM builds one connector object per role; like vLLM's own connectors, this
class is a facade that holds the role's object and forwards to it:
``PrefixStoreScheduler`` (client/vllm/scheduler.py) on the scheduler side,
``PrefixStoreWorker`` (client/vllm/worker.py) on the worker side, with the
plans one hands the other each step in client/vllm/plans.py::

    scheduler                                      worker
    get_num_new_matched_tokens  one lookup         register_kv_caches  views -> VllmKV, staging region
    update_state_after_alloc    -> load plan       start_load_kv       loads start on the client loop
    request_finished(_all_groups) -> save plan,    wait_for_layer_load layer i in place (sync loads)
        blocks held until the worker copied them   save_kv_layer       nothing: saves read the blocks
    build_connector_meta        both plans         wait_for_save       gather finished requests, offer
                                                   get_finished / get_block_ids_with_load_errors

Loads. The scheduler's lookup is of the prompt less its last token (whose
logits are the answer), without a lease: ``get_num_new_matched_tokens`` changes
nothing vLLM or a later lookup sees. The store does count it (its hit and miss
counters, the policies' sightings: store/lookups.py ``learn``), which is why the
scheduler asks once per request and not again when vLLM asks twice (the request
did not fit a step). An entry evicted before the worker reads it
is a failed load, reported to vLLM, which recomputes. Tiers are compared in
tokens: the count returned is the store's reusable length minus the engine's
local hit (vLLM hands the local hit rounded down to its block), so a store
hit that ends mid-block is used to the exact token.

* Plain transformers: KV up to ``kv_tokens``, loaded synchronously and layer
  by layer (vLLM's attention layers call ``wait_for_layer_load``). A failed
  read marks the request's loaded blocks in ``get_block_ids_with_load_errors``;
  vLLM truncates the request there and recomputes.
* Hybrid models (Mamba / GDN groups beside attention): KV and state up to the
  store's state boundary ``state_tokens`` (exact reuse), at any token: in
  ``mamba_cache_mode="align"`` (the mode vLLM's prefix caching of hybrid
  models uses) vLLM reads a new request's initial state from the Mamba block
  at position ``(n - 1) // block_size`` and allocates exactly that block for
  an external hit (plans.py ``CacheGroups.state_index``). These loads are
  asynchronous: vLLM 0.32 cannot map block-level load errors back to requests
  when there is more than one KV cache group (it raises), so a failure is
  reported per request through ``get_transfer_results().failed_recving``.
  Tail-Replay ('replay') would need the engine to rebuild the state by
  replaying a suffix; vLLM cannot, so it is refused at start-up.

Saves. (1) In the step whose forward pass completes a prompt (or ends a
chunk at a junction the store hinted), ``build_connector_meta`` plans a save
of the prompt's KV with the state after it (and the grid state below it); the
worker's ``wait_for_save`` (after that forward pass) copies it out of the
blocks. (2) ``request_finished`` plans a save of everything the request
computed (prompt + N - 1 tokens: the next turn of a conversation replays it)
with the state after exactly those tokens, and keeps its blocks; the worker's
next ``wait_for_save`` copies them and reports the request in
``get_finished`` so vLLM frees the blocks. No decode-phase state is offered
with drafts in flight (speculative decoding) or a step pending (async
scheduling). The next step may be the next request's: a lookup that a save in
flight would lengthen is answered ``None`` (vLLM asks again) until the
workers report the save ended (``build_connector_worker_meta``), and
``has_pending_push_work`` keeps the engine stepping until then. The copy is
all the engine waits for: offer and put run on the client's own loop, and
only what the store wants is sent.

The store is best effort: a store that is down or slow gives misses (0
tokens) and dropped saves, counted in the stats, never an exception in the
engine and never wrong bytes (checksums, zeroed staging, failed loads
recomputed). Requests the namespace cannot key safely (multimodal inputs,
LoRA, prompt embeddings) are neither loaded nor saved.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from ..results import LookupResult
from .layout import LayoutUnsupported
from .plans import CacheGroups, LoadPlan, PrefixStoreMetadata, SavePlan, namespace_for
from .scheduler import PrefixStoreScheduler
from .settings import ConnectorSettings
from .stats import PrefixStorePromMetrics, PrefixStoreStats, StatsBox
from .worker import PrefixStoreWorker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)


class PrefixStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """prefixstore as vLLM's remote KV (and hybrid state) tier. See the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.settings = ConnectorSettings.from_extra_config(extra)
        self._stats = StatsBox()
        groups: CacheGroups | None = None
        try:
            groups = CacheGroups.of(vllm_config, kv_cache_config)
        except LayoutUnsupported as err:
            log.warning("prefixstore connector idle (never loads or saves): %s", err)
        if groups is not None and groups.hybrid and self.settings.mode == "replay":
            raise ValueError("mode: 'replay' (Tail-Replay) needs an engine that rebuilds recurrent state by "
                             "replaying a suffix; vLLM cannot, so use 'exact' on this hybrid model")
        self.scheduler_side: PrefixStoreScheduler | None = None
        self.worker_side: PrefixStoreWorker | None = None
        if role == KVConnectorRole.SCHEDULER and self._kv_transfer_config.kv_load_failure_policy != "recompute":
            # A cache's failed load is a miss: vLLM's default ('fail') would end the request with an
            # error. vLLM's scheduler reads the policy after it built this connector, so this holds.
            log.info("prefixstore: kv_load_failure_policy %r -> 'recompute' (a failed load from a cache is "
                     "recomputed, never an error)", self._kv_transfer_config.kv_load_failure_policy)
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        if groups is not None and role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = PrefixStoreScheduler(vllm_config, groups, self.settings, self._stats,
                                                       self._block_ids_of)
        elif groups is not None:
            self.worker_side = PrefixStoreWorker(vllm_config, groups, self.settings, self._stats)

    @property
    def groups(self) -> CacheGroups | None:
        """The cache groups this connector moves (None: idle)."""
        side = self.scheduler_side or self.worker_side
        return side.groups if side is not None else None

    def _block_ids_of(self, req_id: str) -> tuple[list[int], ...]:
        assert self._kv_cache_manager is not None, "vLLM binds its KV cache manager before scheduling"
        return self._kv_cache_manager.get_block_ids(req_id)

    # ------------------------------------------------------------ both roles

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._stats.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return PrefixStoreStats(data=dict(data)) if data is not None else PrefixStoreStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig, metric_types: dict[type, type], labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]) -> KVConnectorPromMetrics | None:
        return PrefixStorePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for the worker's saves and asynchronous loads in flight (shutdown; tests)."""
        if self.worker_side is not None:
            self.worker_side.drain(timeout_s)

    def shutdown(self) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.worker_side is not None:
            self.worker_side.shutdown()

    # ------------------------------------------------------------ scheduler side

    def loadable_tokens(self, lookup: LookupResult) -> int:
        return self.scheduler_side.loadable_tokens(lookup) if self.scheduler_side is not None else 0

    @property
    def saves_in_flight(self) -> int:
        """Saves planned by the scheduler side that the workers have not reported ended (0 on
        the worker side). An engine driven step by step (tests, benchmarks) steps until it is 0."""
        return self.scheduler_side.saves_in_flight if self.scheduler_side is not None else 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup (counted by the store, answered the same however often asked); the tokens the
        store adds beyond the engine's local hit."""
        if self.scheduler_side is None:
            return 0, False
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.on_new_request(request)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler_side is None:
            return PrefixStoreMetadata()
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def has_pending_push_work(self) -> bool:
        """Saves in flight keep vLLM's engine loop stepping (empty steps) until the workers report
        them ended: the report rides a step's output, and the step that copied a finished
        request's blocks may be the engine's last one otherwise."""
        return self.saves_in_flight > 0

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        """The workers' reports of saves that ended (the scheduler stops holding lookups back for them)."""
        if self.scheduler_side is not None:
            self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of what the request computed; True keeps its blocks until the worker copied them."""
        if self.scheduler_side is None:
            return False, None
        return self.scheduler_side.request_finished(request, block_ids)

    # ------------------------------------------------------------ worker side

    def _meta(self) -> PrefixStoreMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, PrefixStoreMetadata)
        return meta

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None and isinstance(connector_metadata, PrefixStoreMetadata):
            self.worker_side.begin_step(connector_metadata)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's KV views; allocate the staging region once."""
        if self.worker_side is not None:
            self.worker_side.register_kv_caches(kv_caches)  # views it cannot map: it refuses, answering plans

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        if self.worker_side is not None:
            self.worker_side.start_load_kv(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        if self.worker_side is not None:
            self.worker_side.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        """Nothing per layer: a finished request's blocks stay allocated until wait_for_save has
        copied them, so the save reads all layers there at once."""

    def wait_for_save(self) -> None:
        if self.worker_side is not None:
            self.worker_side.wait_for_save(self._meta())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        if self.worker_side is None:
            return KVConnectorTransferResults(finished_sending=set(), finished_recving=set(), failed_recving=set())
        return self.worker_side.get_transfer_results(finished_req_ids, self._meta())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.build_connector_worker_meta() if self.worker_side is not None else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors() if self.worker_side is not None else set()


__all__ = ["CacheGroups", "LoadPlan", "PrefixStoreConnector", "PrefixStoreMetadata", "PrefixStoreStats",
           "SavePlan", "namespace_for"]
