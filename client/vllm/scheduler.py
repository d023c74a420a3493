"""The connector's scheduler side: one lookup per request, load plans for what the store adds
beyond the engine's local hit, save plans at prompt ends and at request ends (see
client/vllm/connector.py for the whole life of a request)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..results import LookupResult
from ..sync import SyncPrefixClient
from .plans import CacheGroups, LoadPlan, PrefixStoreMetadata, SavePlan, namespace_for
from .settings import ConnectorSettings
from .stats import StatsBox

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


def keyable(request: Request) -> bool:
    """Whether the token ids alone identify this request's KV (else: neither load nor save)."""
    return (not request.mm_features and request.lora_request is None
            and getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None)


def extra_keys(request: Request) -> list[bytes]:
    # vLLM isolates prefix caching by cache_salt; so does the store: the salt keys block 0, and
    # every later block chains from it.
    salt = getattr(request, "cache_salt", None)
    return [b"salt:" + salt.encode()] if salt else []


class PrefixStoreScheduler:
    """Scheduler-side state and decisions; it moves no bytes (the worker side does)."""

    def __init__(self, vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings, stats: StatsBox,
                 block_ids_of: Callable[[str], tuple[list[int], ...]]) -> None:
        self._vllm_config = vllm_config
        self.groups = groups
        self.settings = settings
        self._stats = stats
        self._block_ids_of = block_ids_of  # vLLM's KV cache manager: a running request's blocks
        self._client: SyncPrefixClient | None = None
        self._lookups: dict[str, tuple[LookupResult, int]] = {}  # req -> (lookup, local hit) of the latest query
        self._store_start: dict[str, int] = {}  # req -> tokens loaded from the store, block-aligned (save start)
        self._loads: list[LoadPlan] = []
        self._saves: list[SavePlan] = []
        self._requests: dict[str, Request] = {}  # live requests (on_new_request .. finished)
        self._saved_upto: dict[str, int] = {}  # req -> tokens a prompt-end save covered

    def shutdown(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def _client_for_lookups(self) -> SyncPrefixClient:
        if self._client is None:
            self._client = SyncPrefixClient(namespace_for(self._vllm_config, self.groups, self.settings, 0),
                                            self.settings.client)
        return self._client

    def loadable_tokens(self, lookup: LookupResult) -> int:
        """How much of a lookup the engine can take: KV alone on a plain transformer; on a hybrid
        model the state boundary (exact), which must lie on vLLM's state grid."""
        if not lookup.ok:
            return 0
        if not self.groups.hybrid or self.settings.mode == "replay":
            return lookup.kv_tokens
        t = lookup.state_tokens
        return t if t % self.groups.state_block_tokens == 0 else 0

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup (counted by the store, never changing a later answer); the tokens the store
        adds beyond the engine's local hit. Asked again for the same request, the first answer."""
        memo = self._lookups.pop(request.request_id, None)
        if not self.settings.load or not keyable(request):
            return 0, False
        tokens = request.all_token_ids[: request.num_tokens - 1]  # the last token is always computed
        if len(tokens) <= num_computed_tokens:
            return 0, False
        if memo is not None and memo[0].ok and memo[0].num_tokens == len(tokens):
            # Asked again (the request did not fit this step): the same answer, without another
            # lookup, which the store's admission would count as a second sighting of the prefix.
            lookup = memo[0]
        else:
            client = self._client_for_lookups()
            lookup = client.lookup(client.prompt(tokens, extra_keys(request)), lease=False)
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
        self._stats.count("lookups")
        if not lookup.ok:
            self._stats.count("lookup_failures")
        query = lookup.num_tokens - local
        self._stats.count("query_tokens", max(query, 0))
        self._stats.count("kv_hit_tokens", max(min(lookup.kv_tokens - local, query), 0))
        if num_external_tokens <= 0:
            return
        end = local + num_external_tokens
        state_index = None
        if self.groups.hybrid:
            self._stats.count("state_hit_tokens", num_external_tokens)
            state_index = end // self.groups.state_block_tokens - 1
        B = self.settings.block_tokens
        self._store_start[request.request_id] = min(lookup.matched_blocks, end // B) * B
        self._loads.append(LoadPlan(req_id=request.request_id, lookup=lookup, start=local, end=end,
                                    block_ids=blocks.get_block_ids(), state_index=state_index,
                                    is_async=self.groups.hybrid))

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixStoreMetadata:
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
        if (request is None or req_id in self._saved_upto 
                or computed_after_step < request.num_prompt_tokens):
            return
        self._saved_upto[req_id] = 0
        plan = self._save_plan(request, request.num_prompt_tokens,
                               self._block_ids_of(req_id), hold=False)
        if plan is not None:
            self._saved_upto[req_id] = len(plan.tokens)
            self._saves.append(plan)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
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
        if not self.settings.save:
            return None
        if not keyable(request):
            self._stats.count("skipped_requests")
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
                        snapshot=snapshot, extra_keys=extra_keys(request), hold=hold)


__all__ = ["PrefixStoreScheduler", "extra_keys", "keyable"]
