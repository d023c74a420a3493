"""The connector's scheduler side: one lookup per request (every tensor-parallel rank's
namespace), load plans for what the store adds beyond the engine's local hit, save plans at
prompt ends, at junctions the store hints, and at request ends (see client/vllm/connector.py
for the whole life of a request)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixstore.protocol.keys import Origin
from ..client import PrefixClient
from ..results import LookupResult
from .loop import ClientLoop
from .plans import CacheGroups, LoadPlan, PrefixStoreMetadata, PrefixStoreWorkerMeta, SavePlan, namespace_for
from .settings import ConnectorSettings
from .stats import RateLimitedLog, StatsBox

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

#: Rounds of per-rank lookups, each over the prefix the previous one agreed on, before a hybrid
#: model's ranks are taken to share no state boundary (they save the same boundaries, so one
#: round is the rule and a second one follows an eviction on one rank).
TP_LOOKUP_ROUNDS = 3


def keyable(request: Request) -> bool:
    """Whether the token ids alone identify this request's KV (else: neither load nor save)."""
    return (not request.mm_features and request.lora_request is None
            and getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None)


def extra_keys(request: Request) -> list[bytes]:
    # vLLM isolates prefix caching by cache_salt; so does the store: the salt keys block 0, and
    # every later block chains from it.
    salt = getattr(request, "cache_salt", None)
    return [b"salt:" + salt.encode()] if salt else []


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


class PrefixStoreScheduler:
    """Scheduler-side state and decisions; it moves no bytes (the worker side does)."""

    def __init__(self, vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings, stats: StatsBox,
                 block_ids_of: Callable[[str], tuple[list[int], ...]]) -> None:
        self._vllm_config = vllm_config
        self.groups = groups
        self.settings = settings
        self._stats = stats
        self._block_ids_of = block_ids_of  # vLLM's KV cache manager: a running request's blocks
        parallel = vllm_config.parallel_config
        self.tp_size = parallel.tensor_parallel_size
        self._num_workers = parallel.world_size  # workers that each report a save's end
        spec = vllm_config.speculative_config
        self.speculative = spec is not None and (spec.num_speculative_tokens or 0) > 0
        """Draft tokens run through the model: decode-phase Mamba blocks then hold draft states
        (vLLM picks the accepted one on the worker, at the next step), so no decode-phase
        snapshot is ever offered; prefill-phase ones (prompt end, junction) still are."""
        self._loop: ClientLoop | None = None
        self._clients: list[PrefixClient] = []  # one per tensor-parallel rank's namespace
        self._lookups: dict[str, tuple[LookupResult, int, int]] = {}  # req -> (lookup, local hit, loadable)
        self._store_start: dict[str, int] = {}  # req -> tokens loaded from the store (save start)
        self._loads: list[LoadPlan] = []
        self._saves: list[SavePlan] = []
        self._requests: dict[str, Request] = {}  # live requests (on_new_request .. finished)
        self._saved_upto: dict[str, int] = {}  # req -> tokens a prompt-end save covered
        self._junctions: dict[str, int] = {}  # req -> the junction a prefill chunk ends at (checkpoint_hint)
        self._in_flight: dict[str, tuple[np.ndarray, list[bytes], float]] = {}  # save id -> (tokens, extra keys, planned at)
        self._done_reports: dict[str, int] = {}  # save id -> workers that reported its end
        self._save_ids = itertools.count()
        self._log = RateLimitedLog(log)
        self._loading: set[str] = set()
        """Requests with an asynchronous load the workers have not reported finished. Such a request
        may finish (aborted, or failed by vLLM) before its load does; vLLM then frees its blocks
        when the load is reported, so the connector must not also hold them for a save: a second
        release of a freed request is the AssertionError that killed the engine core (issue 29)."""
        self._failed_loads: set[str] = set()
        """Requests whose load failed: vLLM recomputes them and asks again, and they are not loaded
        again (a failure that repeats would otherwise loop)."""
        self.refused: str | None = None
        """Why the workers refuse to move anything (their views could not be mapped), once one said
        so: the scheduler then plans no load and no save."""

    @property
    def saves_in_flight(self) -> int:
        self._forget_stale_saves()
        return len(self._in_flight)

    def _forget_stale_saves(self) -> None:
        now = time.monotonic()
        for save_id, (_, _, planned_at) in list(self._in_flight.items()):
            if now - planned_at > self.settings.save_wait_s:
                del self._in_flight[save_id]
                self._done_reports.pop(save_id, None)

    def shutdown(self) -> None:
        if self._loop is not None:
            self._loop.close(*self._clients)
            self._loop, self._clients = None, []

    # ------------------------------------------------------------ lookups

    def _lookup_clients(self) -> tuple[ClientLoop, list[PrefixClient]]:
        if self._loop is None:
            self._loop = ClientLoop()
            self._clients = [PrefixClient(namespace_for(self._vllm_config, self.groups, self.settings, rank),
                                          self.settings.client) for rank in range(self.tp_size)]
        return self._loop, self._clients

    def loadable_tokens(self, lookup: LookupResult) -> int:
        """How much of one rank's lookup the engine can take: KV alone on a plain transformer; on
        a hybrid model KV and state up to the state boundary (exact), at any token: vLLM's align
        mode reads a new request's initial state from the Mamba block at
        ``(num_computed_tokens - 1) // block_size`` and allocates exactly that block for an external
        hit (single_type_kv_cache_manager.py ``allocate_external_computed_blocks`` with Mamba's
        ``get_num_skipped_tokens = n - 1``), so a boundary off its grid is taken as it is."""
        if not lookup.ok:
            return 0
        if not self.groups.hybrid or self.settings.mode == "replay":
            return lookup.kv_tokens
        return lookup.state_tokens

    def lookup(self, tokens: Sequence[int], extra: list[bytes]) -> tuple[LookupResult, int]:
        """Rank 0's lookup and the tokens every rank can load: a rank never loads a prefix
        another rank's shard lacks. Plain models: the least KV over ranks (KV is causal, so any
        shorter prefix is there too). Hybrid: a state boundary every rank holds; if the ranks'
        largest ones differ, they are asked again for the prefix up to the least of them."""
        loop, clients = self._lookup_clients()
        deadline = time.monotonic() + self.settings.lookup_timeout_s

        async def ask(upto: int) -> list[LookupResult]:
            return list(await asyncio.gather(*(c.lookup(c.prompt(tokens[:upto], extra), lease=False)
                                               for c in clients)))

        def answer(upto: int) -> list[LookupResult] | None:
            # The engine's scheduler waits for this answer, and every request of the engine with
            # it: a store slower than lookup_timeout_s is a miss, not a stalled engine.
            future = loop.submit(ask(upto))
            try:
                return list(future.result(timeout=max(deadline - time.monotonic(), 0.0)))
            except concurrent.futures.TimeoutError:
                future.cancel()
                self._stats.count("lookup_timeouts")
                self._log.warning("prefixstore lookup took longer than lookup_timeout_s (%g s): a miss",
                                  self.settings.lookup_timeout_s)
                return None

        results = answer(len(tokens))
        for _ in range(TP_LOOKUP_ROUNDS):
            if results is None:
                return LookupResult(prompt=clients[0].prompt(tokens, extra), ok=False), 0
            each = [self.loadable_tokens(r) for r in results]
            least = min(each)
            if least == max(each) or not self.groups.hybrid or least == 0:
                return results[0], least
            results = answer(least)
        return results[0] if results is not None else LookupResult(prompt=clients[0].prompt(tokens, extra), ok=False), 0

    def _save_in_flight_extends(self, tokens: Sequence[int], extra: list[bytes], local: int) -> bool:
        """Whether a save this engine has planned and not seen end shares at least one more of
        vLLM's blocks of ``tokens`` than the engine's local hit (the previous turn of this
        conversation, its blocks evicted, say): then the lookup waits for it rather than miss what
        is on its way. Less than a block is not worth a wait: every wait costs the request an
        engine step, and vLLM's own cache, which still holds the previous turn's blocks, leaves
        at most a block's tokens to recompute (measured under concurrent load: 209 waits in 80
        requests, TTFT no better than recomputing). Saves older than ``save_wait_s`` are not
        waited on."""
        self._forget_stale_saves()
        if not self._in_flight:
            return False
        query = np.asarray(tokens, dtype=np.int64)
        worth = local + self.groups.max_block_tokens
        return any(keys == extra and common_prefix(saved, query) >= worth
                   for saved, keys, _ in self._in_flight.values())

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup (counted by the store, never changing a later answer); the tokens the store
        adds beyond the engine's local hit. Asked again for the same request, the first answer.
        None (vLLM asks again next step) while a save in flight would lengthen the answer."""
        memo = self._lookups.pop(request.request_id, None)
        if (not self.settings.load or not keyable(request) or self.refused is not None
                or request.request_id in self._failed_loads):
            return 0, False
        tokens = request.all_token_ids[: request.num_tokens - 1]  # the last token is always computed
        if len(tokens) <= num_computed_tokens:
            return 0, False
        if memo is not None and memo[0].ok and memo[0].num_tokens == len(tokens):
            # Asked again (the request did not fit this step): the same answer, without another
            # lookup, which the store's admission would count as a second sighting of the prefix.
            lookup, loadable = memo[0], memo[2]
        else:
            if self._save_in_flight_extends(tokens, extra_keys(request), num_computed_tokens):
                self._stats.count("save_waits")
                return None, False
            lookup, loadable = self.lookup(tokens, extra_keys(request))
        self._lookups[request.request_id] = (lookup, num_computed_tokens, loadable)
        extra = loadable - num_computed_tokens
        self._plan_junction(request, lookup, max(loadable, num_computed_tokens))
        if extra <= 0:
            return 0, False
        return extra, self.groups.hybrid

    def _plan_junction(self, request: Request, lookup: LookupResult, start: int) -> None:
        """checkpoint_hint: the store has seen the prefix ending at ``hint`` twice without a state
        there. vLLM ends a prefill chunk at ``request.shared_prefix_boundary`` (its Marconi
        junction), but floored to whole blocks from the chunk's start
        (v1/core/sched/scheduler.py ``_mamba_block_aligned_split``: ``block_floored``) unless its
        EAGLE-only exact-junction mode is on. So the connector sets it where the floored stop is
        the junction itself (the prefill resumes on vLLM's grid and the junction lies on it) and
        snapshots there; elsewhere a chunk ending at another token would give a state the store
        did not ask for, and the hint is counted (``junctions_off_grid``), not followed."""
        hint = lookup.checkpoint_hint
        if (not self.groups.hybrid or not self.settings.save or not lookup.ok
                or not start < hint < request.num_prompt_tokens):
            return
        grid = self.groups.state_block_tokens
        if start % grid or (hint - start) % grid or getattr(request, "shared_prefix_boundary", 0) not in (0, hint):
            self._stats.count("junctions_off_grid")
            return
        request.shared_prefix_boundary = hint
        self._junctions[request.request_id] = hint

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        memo = self._lookups.pop(request.request_id, None)
        if memo is None:
            return
        lookup, local, _ = memo
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
            state_index = self.groups.state_index(end)
        B = self.settings.block_tokens
        self._store_start[request.request_id] = min(lookup.matched_blocks, end // B) * B
        if self.groups.hybrid:
            self._loading.add(request.request_id)
        self._loads.append(LoadPlan(req_id=request.request_id, lookup=lookup, start=local, end=end,
                                    block_ids=blocks.get_block_ids(), state_index=state_index,
                                    is_async=self.groups.hybrid))

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request

    # ------------------------------------------------------------ saves

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixStoreMetadata:
        """This step's loads, finished requests' saves, and a save of every prompt whose prefill
        (or a junction chunk of it) this step completes: the worker gathers it after the forward
        pass that wrote it, while the state after exactly that many tokens is still the request's
        running state. Saving at the prompt end, not only at the finish, is what lets a request
        arriving while this one decodes hit."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_step_save(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_step_save(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        meta = PrefixStoreMetadata(loads=self._loads, saves=self._saves,
                                   idle=scheduler_output.total_num_scheduled_tokens == 0,
                                   num_reqs=len(scheduled), num_tokens=scheduler_output.total_num_scheduled_tokens)
        self._loads, self._saves = [], []
        return meta

    def _plan_step_save(self, req_id: str, computed_after_step: int) -> None:
        request = self._requests.get(req_id)
        if request is None or self.refused is not None:
            return
        junction = self._junctions.get(req_id)
        if junction is not None and computed_after_step >= junction:
            del self._junctions[req_id]
            if computed_after_step == junction:  # this chunk ends at the junction
                plan = self._save_plan(request, junction, self._block_ids_of(req_id), hold=False,
                                       snapshots={junction: Origin.JUNCTION})
                if plan is not None:
                    self._stats.count("junction_stops")
                    self._queue(plan)
        if req_id in self._saved_upto or computed_after_step < request.num_prompt_tokens:
            return
        self._saved_upto[req_id] = 0
        P = request.num_prompt_tokens
        # The state after P is the running state only if this step stopped there (a resumed
        # request replaying its output runs past it); the one on vLLM's grid below P is the state
        # vLLM itself keeps for its prefix cache (a prefill chunk ended there), which serves a
        # sibling prompt that diverges between the two.
        snapshots = {self._grid_floor(P): Origin.PERIODIC}
        if computed_after_step == P:
            snapshots[P] = Origin.PROMPT_END  # wins over the grid's label where P is on the grid
        plan = self._save_plan(request, P, self._block_ids_of(req_id), hold=False, snapshots=snapshots)
        if plan is not None:
            self._saved_upto[req_id] = len(plan.tokens)
            self._queue(plan)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of everything the request computed -- prompt + N - 1 tokens after N were
        sampled (the last one was never fed through the model) -- with the state after exactly
        those tokens, so the next turn of the conversation resumes at the end of this one. True
        keeps the blocks until the worker copied them."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._requests.pop(req_id, None)
        self._junctions.pop(req_id, None)
        self._failed_loads.discard(req_id)
        saved = self._saved_upto.pop(req_id, 0)
        if req_id in self._loading or self.refused is not None:
            # Finished while its load is in flight (its blocks hold nothing computed, and vLLM frees
            # them when the load is reported), or nothing is saved any more.
            self._store_start.pop(req_id, None)
            return False, None
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        # The running state is that of num_computed_tokens, all of them known tokens the model
        # accepted: not with drafts (speculative decoding leaves draft states in the decode-phase
        # blocks until the next step picks the accepted one), not with a step whose token is
        # still a placeholder (async scheduling).
        exact = (not self.speculative and request.num_output_placeholders == 0
                 and not request.spec_token_ids and computed == request.num_computed_tokens)
        if self.groups.hybrid and not exact and computed > saved:
            self._stats.count("snapshots_withheld")
        snapshots: dict[int, Origin] = {}
        if not self.speculative:
            snapshots[self._grid_floor(computed)] = Origin.PERIODIC
        if exact:
            # The state after everything the model consumed: past the prompt, the generation end
            # (P + N - 1, what the next turn of a conversation replays); at or below it, the
            # prompt end or a state inside it (a request finished, or aborted, in its prefill).
            P = request.num_prompt_tokens
            snapshots[computed] = (Origin.GENERATION_END if computed > P
                                   else Origin.PROMPT_END if computed == P else Origin.UNKNOWN)
        plan = self._save_plan(request, computed, block_ids, hold=True, snapshots=snapshots)
        self._store_start.pop(req_id, None)
        if plan is None or len(plan.tokens) <= saved:
            return False, None  # nothing beyond what the prompt-end save covered
        self._queue(plan)
        return True, None

    def _queue(self, plan: SavePlan) -> None:
        self._saves.append(plan)
        self._in_flight[plan.save_id] = (np.asarray(plan.tokens, dtype=np.int64), plan.extra_keys, time.monotonic())

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' reports: loads that ended (and failed), saves that ended (a save is over
        once every worker reported it), and whether a worker refuses."""
        for req_id in output.finished_recving or ():
            self._loading.discard(req_id)
        self._failed_loads.update(output.failed_recving or ())
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PrefixStoreWorkerMeta):
            return
        if meta.refused and self.refused is None:
            self.refused = meta.refused[0]
            log.warning("prefixstore: a worker refuses to move KV (%s); this engine stops loading and saving",
                        self.refused)
        for save_id, n in meta.saves_done.items():
            reported = self._done_reports.get(save_id, 0) + n
            if reported >= self._num_workers:
                self._done_reports.pop(save_id, None)
                self._in_flight.pop(save_id, None)
            else:
                self._done_reports[save_id] = reported

    def _grid_floor(self, t: int) -> int:
        grid = self.groups.state_block_tokens
        return t // grid * grid if grid else 0

    def _save_plan(self, request: Request, computed: int, block_ids: tuple[list[int], ...], *, hold: bool,
                   snapshots: dict[int, Origin]) -> SavePlan | None:
        """A save of the request's KV [0, computed) and, on a hybrid model, the states after each
        boundary of ``snapshots`` (0 ignored) whose Mamba block vLLM still holds, each offered with
        its origin: the prompt end, the generation end, a hinted junction, or a state on vLLM's
        block grid (PERIODIC: vLLM's own prefix cache keeps states every block_size tokens)."""
        if not self.settings.save:
            return None
        if not keyable(request):
            self._stats.count("skipped_requests")
            return None
        if computed < 1:
            return None
        kept: list[int] = []
        if self.groups.hybrid:
            for t in sorted(snapshots):
                index = self.groups.state_index(t)
                if 0 < t <= computed and all(index < len(block_ids[g]) and block_ids[g][index] != 0
                                             for g, _, _ in self.groups.mamba):
                    kept.append(t)  # else that state block is gone (vLLM keeps only the latest ones)
        start = self._store_start.get(request.request_id, 0)
        return SavePlan(req_id=request.request_id, save_id=f"{request.request_id}#{next(self._save_ids)}",
                        tokens=list(request.all_token_ids[:computed]), start=min(start, computed),
                        block_ids=tuple(list(b) for b in block_ids), snapshots=tuple(kept),
                        origins={t: int(snapshots[t]) for t in kept}, extra_keys=extra_keys(request), hold=hold)

__all__ = ["PrefixStoreScheduler", "TP_LOOKUP_ROUNDS", "common_prefix", "extra_keys", "keyable"]
