"""The connector's scheduler side: one lookup per request (one namespace for every
tensor-parallel rank: the layout names the model's heads, not a rank's), load plans for what the
store adds beyond the engine's local hit, save plans at prompt ends, at junctions the store
hints, and at request ends (see client/vllm/connector.py for the whole life of a request)."""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from prefixstore.protocol.keys import Origin
from ..client import PrefixClient
from ..pagekeys import SALT_PREFIX
from ..prompt import Prompt
from ..results import LookupResult
from .costs import CostFigures, LoadWaits
from .loop import ClientLoop
from .plans import CacheGroups, LoadPlan, PrefixStoreMetadata, PrefixStoreWorkerMeta, SavePlan, namespace_for, store_prompt
from .settings import ConnectorSettings
from .stats import RateLimitedLog, StatsBox

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger(__name__)

PD_PARAMS = "prefixstore"
"""The key of ``kv_transfer_params`` under which a prefill instance tells the decode instance what it
saved (namespace, kv_tokens, state_tokens): vLLM carries the dict from the prefill response to the
decode request (its disaggregation proxy copies it), the other keys are vLLM's own."""
PD_TRUNCATED = "prefixstore_truncated"
"""Set in a prefill request's ``kv_transfer_params`` once its prompt lost its last token (a request
preempted and scheduled again is not cut twice)."""

def keyable(request: Request) -> bool:
    """Whether the token ids alone identify this request's KV (else: neither load nor save)."""
    return (not request.mm_features and request.lora_request is None
            and getattr(request, "prompt_embeds", None) is None and request.prompt_token_ids is not None)


def extra_keys(request: Request) -> list[bytes]:
    # vLLM isolates prefix caching by cache_salt; so does the store: the salt keys block 0, and
    # every later block chains from it.
    salt = getattr(request, "cache_salt", None)
    return [SALT_PREFIX + salt.encode()] if salt else []


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def wait_for_answer(future: concurrent.futures.Future[Any], timeout_s: float) -> bool:
    """Whether ``future`` is done within ``timeout_s`` (the one place the scheduler blocks on a lookup)."""
    done, _ = concurrent.futures.wait([future], timeout=timeout_s)
    return bool(done)


DEFERRED_LOOKUP_MAX_S = 2.0
"""The longest a busy engine's lookup may take before it is a miss, however long recomputing what it
could bring would take (PrefixStoreScheduler.lookup)."""

wait_clock = time.monotonic
"""The clock of measured load waits (costs.LoadWaits); a module name, so a test can set it alone."""

REMEASURE_EVERY = 8
"""Under ``load_policy: when_faster``, one hit in this many of those the engine's figures say not to
load is loaded anyway, so that the figures are measured again: a load not made is a figure not
updated, and figures made pessimistic once (a busy spell, a poor fit) would keep every later hit
from loading. The price: where the figures are right, one in this many of the loads they would
skip is made and loses what they predict. Recovery is gradual: the fit is over the last
``costs.LOAD_SAMPLES`` loads."""


@dataclass
class PendingLookup:
    """A request's lookup, sent to the store and not yet answered (vLLM asks again next step)."""

    prompt: Prompt
    future: concurrent.futures.Future[LookupResult]
    sent_at: float
    num_tokens: int
    budget_s: float
    """How long after ``sent_at`` an unanswered lookup becomes a miss (PrefixStoreScheduler.lookup)."""
    deferred: bool = False
    """Whether the request has been told "not yet" (counted once: ``lookups_deferred``)."""


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
        role = vllm_config.kv_transfer_config.kv_role if vllm_config.kv_transfer_config is not None else None
        self.loads = settings.load and role != "kv_producer"
        """Whether this engine loads: not a prefill instance (``kv_producer``) of a disaggregated pair."""
        self.saves = settings.save and role != "kv_consumer"
        """Whether this engine saves: not a decode instance (``kv_consumer``)."""
        self.namespace = namespace_for(vllm_config, groups, settings)
        self._promised: dict[str, int] = {}  # req -> tokens a prefill instance said it saved (decode side)
        self._loop: ClientLoop | None = None
        self._client: PrefixClient | None = None
        self._lookups: dict[str, tuple[LookupResult, int, int]] = {}  # req -> (lookup, local hit, loadable)
        self._store_start: dict[str, int] = {}  # req -> tokens loaded from the store (save start)
        self._loads: list[LoadPlan] = []
        self._saves: list[SavePlan] = []
        self._requests: dict[str, Request] = {}  # live requests (on_new_request .. finished)
        self._saved_upto: dict[str, int] = {}  # req -> tokens a prompt-end save covered
        self._saved_state: dict[str, int] = {}  # req -> the largest snapshot boundary it covered
        self._copied_upto: dict[str, int] = {}  # req -> tokens earlier saves of it copied out of its blocks
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
        self._wait_since: dict[str, float] = {}  # req -> when its lookup first waited for a save in flight
        self._unlooked: dict[str, int] = {}  # req -> the tokens a lookup could have added, not looked up
        self._unsaved: set[str] = set()  # requests not looked up, and so not saved (_no_load_pays)
        self._remeasure: set[str] = set()  # requests looked up to measure the figures again (_no_load_pays)
        self._pending: dict[str, PendingLookup] = {}  # req -> its lookup, sent and not yet answered
        self._idle = True
        """Whether the engine's last step scheduled no token (a lookup may then hold the scheduler)."""
        self._block_left = 0.0  # of lookup_block_s, this step (a busy engine's scheduler)
        self._store_slow = False  # a lookup timed out and none was answered since
        self._skipped = 0  # hits the cost figures kept from loading since the last one loaded anyway
        self.costs = CostFigures()
        """The workers' latest figures of what loads and recomputing cost, with the wait this
        scheduler measured (costs.py)."""
        self._waits = LoadWaits()
        self._load_planned: dict[str, tuple[int, float, int]] = {}
        """Requests with an asynchronous load: the step and time it was planned at, and its tokens
        (``LoadWaits``)."""
        self._step_no = 0  # build_connector_meta calls: which loads were planned in the same step
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
            self._loop.close(self._client)
            self._loop, self._client = None, None

    # ------------------------------------------------------------ lookups

    def _lookup_client(self) -> tuple[ClientLoop, PrefixClient]:
        if self._loop is None or self._client is None:
            self._loop = ClientLoop()
            self._client = PrefixClient(self.namespace, self.settings.client)
        return self._loop, self._client

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

    def lookup(self, req_id: str, tokens: Sequence[int], extra: list[bytes], local: int = 0,
               extend: bool = True) -> tuple[LookupResult, int] | None:
        """The store's answer for ``tokens`` and the tokens the engine can load, or None: not yet
        (vLLM asks again next step). One lookup whatever the tensor-parallel size (every rank
        reads its own heads of the same entries).

        vLLM's scheduler calls this on the engine's thread, and every request of the engine waits
        while it does. So the scheduler waits for answers only while that costs nobody else:
        * the engine's last step scheduled nothing (idle): up to ``lookup_timeout_s``;
        * the engine is running requests: at most ``lookup_block_s`` per step, shared by every
          waiting request asked in that step (vLLM asks each of them every step). A lookup not
          answered by then goes on in the background and the request is asked again next step
          (counted once, ``lookups_deferred``), while the running requests take their step:
          measured under concurrent load, 8-32 lookups a run took longer than 0.25 s, and each
          stalled every request of its engine that long (docs/benchmarks.md, vLLM serving).
        A lookup unanswered ``lookup_timeout_s`` after it was sent is a miss for that request
        (``lookup_timeouts``), never a stalled engine; one sent while the engine was busy (and
        ``extend``: not a decode instance's promised load, which waits for its commit on the
        worker anyway) is given longer, as long as recomputing the tokens it could bring (``local``
        of them the engine holds) would take by the engine's measured prefill cost, up to
        ``DEFERRED_LOOKUP_MAX_S``: it holds nobody else back, and giving up turns a hit into that
        recompute (measured on the wide model at 8 in flight: 44 of 96 lookups missed at 0.25 s,
        each then recomputing about a thousand tokens at 0.7-0.9 ms a token). Not after a lookup
        timed out, until one is answered again: a store that does not answer would otherwise
        cost every request that much."""
        pending = self._pending.get(req_id)
        if pending is not None and pending.num_tokens != len(tokens):  # preempted, and longer now
            self._drop_pending(req_id)
            pending = None
        if pending is None:
            loop, client = self._lookup_client()
            prompt = store_prompt(client, self.settings.keys, tokens, extra)
            budget = self.settings.lookup_timeout_s
            recompute = self.costs.prefill_s_per_token
            if extend and not self._idle and not self._store_slow and recompute is not None:
                budget = max(budget, min(recompute * (len(tokens) - local), DEFERRED_LOOKUP_MAX_S))
            pending = PendingLookup(prompt, loop.submit(client.lookup(prompt, lease=False)), time.monotonic(),
                                    len(tokens), budget)
            self._pending[req_id] = pending
        left = pending.budget_s - (time.monotonic() - pending.sent_at)
        if self._idle:
            wait = max(min(left, self.settings.lookup_timeout_s), 0.0)
        else:
            wait = max(min(left, self._block_left), 0.0)
        started = time.monotonic()
        done = wait_for_answer(pending.future, wait)
        if not self._idle:
            self._block_left = max(self._block_left - (time.monotonic() - started), 0.0)
        if not done:
            if left > wait:
                if not pending.deferred:
                    pending.deferred = True
                    self._stats.count("lookups_deferred")
                return None
            self._drop_pending(req_id)
            self._store_slow = True
            self._stats.count("lookup_timeouts")
            self._log.warning("prefixstore lookup unanswered after %.3g s (lookup_timeout_s %g): a miss",
                              pending.budget_s, self.settings.lookup_timeout_s)
            return LookupResult(prompt=pending.prompt, ok=False), 0
        del self._pending[req_id]
        try:
            result: LookupResult = pending.future.result()
        except Exception as err:  # noqa: BLE001 -- vLLM's scheduler must never see it: a miss
            self._log.warning("prefixstore lookup failed, a miss: %s: %s", type(err).__name__, err)
            return LookupResult(prompt=pending.prompt, ok=False), 0
        if result.ok:
            self._store_slow = False
        return result, self.loadable_tokens(result)

    @property
    def lookups_pending(self) -> int:
        """Lookups sent and not yet answered (or given up)."""
        return len(self._pending)

    def _drop_pending(self, req_id: str) -> None:
        pending = self._pending.pop(req_id, None)
        if pending is not None:
            pending.future.cancel()

    def _save_in_flight_extends(self, req_id: str, tokens: Sequence[int], extra: list[bytes], local: int) -> bool:
        """Whether the lookup of ``req_id`` waits (vLLM asks again next step) for a save this engine
        has planned and not seen end, one that shares at least one more of vLLM's blocks of
        ``tokens`` than the engine's local hit (the previous turn of this conversation, its blocks
        evicted, say): rather than miss what is on its way.

        Every wait costs the request at least an engine step, so it is bounded twice:
        * less than a block is not worth a wait: vLLM's own cache, which still holds the previous
          turn's blocks, leaves at most a block's tokens to recompute (measured under concurrent
          load: 209 waits in 80 requests, TTFT no better than recomputing);
        * a request waits no longer, in all, than loading the tokens the save adds would gain it
          against recomputing them (``CostFigures.load_gain_s``: at most what recomputing them
          costs; ``save_wait_s`` until prefill has been measured, and never past it): a save queued behind others must not cost more than
          it brings (measured on two busy replicas: lookups held 1.5 s for 130 tokens that
          recompute in 0.1 s).
        Saves older than ``save_wait_s`` are not waited on."""
        self._forget_stale_saves()
        if not self._in_flight:
            self._wait_since.pop(req_id, None)
            return False
        query = np.asarray(tokens, dtype=np.int64)
        shared = max((common_prefix(saved, query) for saved, keys, _ in self._in_flight.values() if keys == extra),
                     default=0)
        gain_tokens = shared - local
        if gain_tokens < self.groups.max_block_tokens:
            self._wait_since.pop(req_id, None)
            return False
        now = time.monotonic()
        since = self._wait_since.setdefault(req_id, now)
        gain_s = self.costs.load_gain_s(gain_tokens)
        budget = self.settings.save_wait_s if gain_s is None else min(gain_s, self.settings.save_wait_s)
        if now - since >= budget:
            if now > since:  # it did wait, and stops: counted once (the memo answers later asks)
                self._stats.count("save_waits_ended")
            self._wait_since.pop(req_id, None)
            return False
        return True

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """One lookup (counted by the store, never changing a later answer); the tokens the store
        adds beyond the engine's local hit. Asked again for the same request, the first answer.
        None (vLLM asks again next step) while a save in flight would lengthen the answer, and
        while a busy engine's lookup has not been answered yet (:meth:`lookup`).

        On a decode instance (prefill/decode disaggregation), a request whose prefill instance
        said what it saved (``kv_transfer_params``, :meth:`request_finished`) is promised that
        much: if the store does not hold it yet (the prefill's save may still be on its way, or the
        lookup was slower than ``lookup_timeout_s``), the load is planned anyway, asynchronous, and
        waits for the commit on the worker (bounded by ``commit_wait_s``, then vLLM recomputes):
        never a race with the prefill instance."""
        memo = self._lookups.pop(request.request_id, None)
        if (not self.loads or not keyable(request) or self.refused is not None
                or request.request_id in self._failed_loads or getattr(request, "skip_reading_prefix_cache", False)):
            self._drop_pending(request.request_id)
            return 0, False
        tokens = request.all_token_ids[: request.num_tokens - 1]  # the last token is always computed
        if len(tokens) <= num_computed_tokens:
            self._drop_pending(request.request_id)
            return 0, False
        if memo is not None and memo[0].num_tokens == len(tokens):
            # Asked again (the request did not fit this step): the same answer, without another
            # lookup, which the store's admission would count as a second sighting of the prefix.
            # A lookup that failed or was given up stays a miss: looked up again, it could be
            # deferred again, and the request would wait at each of its chances to be scheduled.
            lookup, loadable = memo[0], memo[2]
        else:
            params = getattr(request, "kv_transfer_params", None) or {}
            # Not looked up last time it was asked (a step it did not fit): decided again here.
            unlooked = self._unlooked.pop(request.request_id, None)
            if request.request_id not in self._pending and self._no_load_pays(
                    request.request_id, params, len(tokens) - num_computed_tokens, unlooked):
                return 0, False
            if (request.request_id not in self._pending
                    and self._save_in_flight_extends(request.request_id, tokens, extra_keys(request),
                                                     num_computed_tokens)):
                self._stats.count("save_waits")
                return None, False
            answer = self.lookup(request.request_id, tokens, extra_keys(request), num_computed_tokens,
                                 extend=not params.get("do_remote_prefill"))
            if answer is None:
                return None, False  # still on its way: asked again next step
            lookup, loadable = answer
            remeasure = request.request_id in self._remeasure
            self._remeasure.discard(request.request_id)
            promised = self._promise(request, len(tokens))
            # Even when this lookup failed or timed out: a store busy taking the prefill's put
            # answers late (lookup_timeout_s bounds the scheduler, not the worker); the worker's
            # wait ends at its first failed poll, so a store that is down costs one round trip.
            if promised > loadable and self.settings.commit_wait_s > 0:
                self._promised[request.request_id] = promised
                loadable = promised
            # A prefill instance's promise (stored yet or not) is loaded whatever it costs:
            # computing the prompt is the prefill's work, and a decode instance recomputing it
            # would undo the split. Decided once per request: asked again, the first answer.
            if (loadable > num_computed_tokens and self.groups.hybrid and not promised
                    and self.settings.load_policy == "when_faster"):
                self._report_costs()
                if self.costs.load_pays(loadable - num_computed_tokens):
                    pass
                elif self._skipped + 1 < REMEASURE_EVERY:
                    # An asynchronous load of this many tokens would not beat recomputing them here.
                    # (Not reset by the hits that pay: those may all be of the size the figures
                    # already know, and the others would then never be measured.)
                    self._skipped += 1
                    self._stats.count("loads_skipped")
                    loadable = num_computed_tokens
                else:
                    # Made anyway: figures that say no load pays would otherwise never be measured
                    # again (a busy spell's slow loads, an estimate off), and the store never used.
                    self._skipped = 0
                    self._stats.count("loads_remeasured")
            if remeasure:
                # Looked up to measure the figures again: whatever it found, the count of requests
                # not looked up starts again (a miss would otherwise have every later one looked up).
                self._skipped = 0
        extra = loadable - num_computed_tokens
        self._lookups[request.request_id] = (lookup, num_computed_tokens, loadable)
        self._plan_junction(request, lookup, max(loadable, num_computed_tokens))
        if extra <= 0:
            return 0, False
        return extra, self.groups.hybrid or request.request_id in self._promised

    def _no_load_pays(self, req_id: str, params: dict[str, Any], most: int, unlooked: int | None) -> bool:
        """Whether this request is not looked up at all: under ``load_policy: when_faster``, on a
        hybrid model, when the engine's figures say that no load of it would beat recomputing,
        not even one of all ``most`` tokens it does not hold. (Where a load of all of them does
        not pay, no smaller one does: a load's gain against recomputing is convex in its tokens
        and at most 0 at none, every figure set of costs.py.) The lookup could then change
        nothing but cost: its round trip holds the scheduler (``lookup_block_s``) or defers the
        request a step, and the store and the client's thread spend CPU the engine is short of.
        Counted (``lookups_skipped``); one in ``REMEASURE_EVERY`` is looked up anyway, and a hit
        then loaded, so the figures are measured again. Asked again for the same request (it
        did not fit this step; ``unlooked``: what it lacked then) and still lacking as much, the
        same answer, counted once. A prefill instance's promise is always looked up."""
        if (not self.groups.hybrid or self.settings.load_policy != "when_faster" or params.get("do_remote_prefill")
                or self.costs.load_pays(most)):
            return False
        if unlooked == most:
            self._unlooked[req_id] = most
            return True
        self._report_costs()
        if self._skipped + 1 >= REMEASURE_EVERY:
            self._remeasure.add(req_id)  # looked up; a hit is then loaded anyway (get_num_new_matched_tokens)
            return False
        self._skipped += 1
        self._unlooked[req_id] = most
        self._stats.count("lookups_skipped")
        return True

    def _report_costs(self) -> None:
        for key, value in self.costs.as_us().items():  # what a load decision used, for the operator
            self._stats.set(key, value)

    def _promise(self, request: Request, num_tokens: int) -> int:
        """The tokens [0, t) a prefill instance said it saved for this request, that this engine can
        take (a state boundary on a hybrid model, any prefix of the KV on a plain one); 0 without
        a promise, or one made in another namespace (a misconfigured pair: counted, never waited on)."""
        params = getattr(request, "kv_transfer_params", None) or {}
        promise = params.get(PD_PARAMS) if params.get("do_remote_prefill") else None
        if not isinstance(promise, dict):
            return 0
        if promise.get("namespace") != self.namespace.id_hex:
            self._stats.count("pd_namespace_mismatches")
            self._log.warning("prefixstore: the prefill instance saved in namespace %s, this engine keys %s "
                              "(model_id, dtype, block_tokens or keys differ): recomputing",
                              promise.get("namespace"), self.namespace.id_hex)
            return 0
        kv, state = int(promise.get("kv_tokens", 0)), int(promise.get("state_tokens", 0))
        if self.groups.hybrid:
            return state if 0 < state <= min(kv, num_tokens) else 0
        return min(kv, num_tokens)

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
        if (not self.groups.hybrid or not self.saves or not lookup.ok
                or not start < hint < request.num_prompt_tokens):
            return
        grid = self.groups.state_block_tokens
        if start % grid or (hint - start) % grid or getattr(request, "shared_prefix_boundary", 0) not in (0, hint):
            self._stats.count("junctions_off_grid")
            return
        request.shared_prefix_boundary = hint
        self._junctions[request.request_id] = hint

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        if self._idle:  # a request admitted in this step: the rest of the step holds somebody
            self._idle = False
            self._block_left = self.settings.lookup_block_s
        if self._unlooked.pop(request.request_id, None) is None:
            self._unsaved.discard(request.request_id)  # looked up after all (preempted, asked again)
        elif request.request_id not in self._copied_upto:
            self._unsaved.add(request.request_id)  # (a request preempted after a save began keeps saving)
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
        B = self.settings.block_tokens
        if num_external_tokens <= 0:
            if lookup.ok and lookup.matched_blocks:
                # The store holds the prompt's blocks up to its match: this request's saves start
                # there instead of offering them again (the offer would answer "have" to each, at
                # the cost of copying them out of the blocks, hashing and offering them, on the
                # engine's thread and the store's). Should the block below the start be evicted
                # before the save, the store refuses the save's blocks (their parent is gone): the
                # save is lost, never wrong, and the next request's lookup, finding less, saves from
                # lower down.
                self._store_start[request.request_id] = min(lookup.matched_blocks * B, lookup.num_tokens)
            else:
                self._store_start.pop(request.request_id, None)  # an earlier allocation's (preempted)
            return
        end = local + num_external_tokens
        state_index = None
        if self.groups.hybrid:
            self._stats.count("state_hit_tokens", num_external_tokens)
            state_index = self.groups.state_index(end)
        self._store_start[request.request_id] = min(lookup.matched_blocks, end // B) * B
        waits = self._promised.pop(request.request_id, None) is not None
        is_async = self.groups.hybrid or waits
        if is_async:
            self._loading.add(request.request_id)
            if not waits:  # a promised load waits for a commit: not what a load costs
                self._load_planned[request.request_id] = (self._step_no, wait_clock(), num_external_tokens)
        if waits:
            self._stats.count("commit_waits")
        self._loads.append(LoadPlan(req_id=request.request_id, lookup=lookup, start=local, end=end,
                                    block_ids=blocks.get_block_ids(), state_index=state_index,
                                    is_async=is_async, tokens=tuple(request.all_token_ids[:end]), commit_wait=waits))

    def on_new_request(self, request: Request) -> None:
        self._requests[request.request_id] = request
        params = getattr(request, "kv_transfer_params", None) or {}
        if self.saves and self.groups.hybrid and params.get("do_remote_decode") and not params.get(PD_TRUNCATED) \
                and request.num_prompt_tokens > 1 and request.prompt_token_ids is not None:
            # A prefill instance of a hybrid model stops one token short: the decode instance
            # computes the prompt's last token itself (its logits are the first answer), so it
            # needs the state *before* that token, h(N-1), which no chunk of a whole prefill
            # leaves behind. vLLM's own NIXL connector does the same (``_truncate_request_for_prefill``).
            del request.prompt_token_ids[-1]
            del request._all_token_ids[-1]
            request.num_prompt_tokens -= 1
            request.max_tokens = 1
            params[PD_TRUNCATED] = True

    # ------------------------------------------------------------ saves

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> PrefixStoreMetadata:
        """This step's loads, finished requests' saves, and a save of every prompt whose prefill
        (or a junction chunk of it) this step completes: the worker gathers it after the forward
        pass that wrote it, while the state after exactly that many tokens is still the request's
        running state. Saving at the prompt end, not only at the finish, is what lets a request
        arriving while this one decodes hit."""
        self._step_no += 1
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self._plan_step_save(new.req_id, new.num_computed_tokens + scheduled.get(new.req_id, 0))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            self._plan_step_save(req_id, cached.num_computed_tokens[i] + scheduled.get(req_id, 0))
        self._idle = scheduler_output.total_num_scheduled_tokens == 0
        self._block_left = self.settings.lookup_block_s
        meta = PrefixStoreMetadata(loads=self._loads, saves=self._saves,
                                   idle=scheduler_output.total_num_scheduled_tokens == 0,
                                   num_reqs=len(scheduled), num_tokens=scheduler_output.total_num_scheduled_tokens)
        self._loads, self._saves = [], []
        return meta

    def _loads_ended(self, req_ids: Sequence[str]) -> None:
        """Loads the workers report ended: what each cost its request (``LoadWaits``), one sample
        per step they were planned in (those wait alike)."""
        now = wait_clock()
        by_step: dict[int, tuple[float, list[int]]] = {}
        for req_id in req_ids:
            planned = self._load_planned.pop(req_id, None)
            if planned is not None:
                step, at, n = planned
                by_step.setdefault(step, (at, []))[1].append(n)
        for at, sizes in by_step.values():
            self._waits.add(round(sum(sizes) / len(sizes)), now - at, now)
        if by_step:
            self.costs = self._waits.apply(self.costs, now)

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
                    self._copied_upto[req_id] = len(plan.tokens)
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
        plan = self._save_plan(request, P, self._block_ids_of(req_id), hold=False, snapshots=snapshots,
                               start_at=self._copied_upto.get(req_id, 0))
        if plan is not None:
            self._saved_upto[req_id] = len(plan.tokens)
            self._saved_state[req_id] = max(plan.snapshots, default=0)
            self._copied_upto[req_id] = len(plan.tokens)
            self._queue(plan)

    def request_finished(self, request: Request, block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of everything the request computed -- prompt + N - 1 tokens after N were
        sampled (the last one was never fed through the model) -- with the state after exactly
        those tokens, so the next turn of the conversation resumes at the end of this one. True
        keeps the blocks until the worker copied them."""
        req_id = request.request_id
        self._lookups.pop(req_id, None)
        self._unlooked.pop(req_id, None)
        self._remeasure.discard(req_id)
        self._drop_pending(req_id)
        self._requests.pop(req_id, None)
        self._junctions.pop(req_id, None)
        self._promised.pop(req_id, None)
        self._failed_loads.discard(req_id)
        self._wait_since.pop(req_id, None)
        self._load_planned.pop(req_id, None)
        copied = self._copied_upto.pop(req_id, 0)
        saved = self._saved_upto.pop(req_id, 0)
        state = self._saved_state.pop(req_id, 0)
        plan = self._finish(request, block_ids, saved, copied)
        self._unsaved.discard(req_id)
        if plan is not None:
            saved, state = len(plan.tokens), max(state, max(plan.snapshots, default=0))
        return plan is not None, self._handoff(request, saved, state)

    def _handoff(self, request: Request, saved: int, state: int) -> dict[str, Any] | None:
        """On a prefill instance (a request vLLM's disaggregation proxy sent with
        ``do_remote_decode``), what the decode instance needs, returned in the response's
        ``kv_transfer_params``: the store holds (or is committing) KV [0, kv_tokens) and the state
        at ``state_tokens`` in ``namespace``; the decode instance loads them, waiting for the commit."""
        params = getattr(request, "kv_transfer_params", None) or {}
        if not params.get("do_remote_decode"):
            return None
        promise: dict[str, object] = {"namespace": self.namespace.id_hex, "kv_tokens": saved, "state_tokens": state}
        return {"do_remote_prefill": True, "do_remote_decode": False, PD_PARAMS: promise if saved else None}

    def _finish(self, request: Request, block_ids: tuple[list[int], ...], saved: int, copied: int) -> SavePlan | None:
        """Plan the request-end save (None: nothing beyond what the prompt-end save covered);
        ``copied``: the tokens earlier saves of it copied out of its blocks."""
        req_id = request.request_id
        if req_id in self._loading or self.refused is not None:
            # Finished while its load is in flight (its blocks hold nothing computed, and vLLM frees
            # them when the load is reported), or nothing is saved any more.
            self._store_start.pop(req_id, None)
            return None
        computed = min(request.num_computed_tokens, len(request.all_token_ids))
        # The running state is that of num_computed_tokens, all of them known tokens the model
        # accepted: not with drafts (speculative decoding leaves draft states in the decode-phase
        # blocks until the next step picks the accepted one), not with a step whose token is
        # still a placeholder (async scheduling).
        exact = (not self.speculative and request.num_output_placeholders == 0
                 and not request.spec_token_ids and computed == request.num_computed_tokens)
        if self.groups.hybrid and not exact and computed > saved and self.saves:
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
        plan = self._save_plan(request, computed, block_ids, hold=True, snapshots=snapshots,
                               start_at=copied)
        self._store_start.pop(req_id, None)
        if plan is None or len(plan.tokens) <= saved:
            return None  # nothing beyond what the prompt-end save covered
        self._queue(plan)
        return plan

    def _queue(self, plan: SavePlan) -> None:
        self._saves.append(plan)
        self._in_flight[plan.save_id] = (np.asarray(plan.tokens, dtype=np.int64), plan.extra_keys, time.monotonic())

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        """The workers' reports: loads that ended (and failed), saves that ended (a save is over
        once every worker reported it), and whether a worker refuses."""
        for req_id in output.failed_recving or ():
            self._load_planned.pop(req_id, None)  # recomputed: its wait says nothing of a load's
        for req_id in output.finished_recving or ():
            self._loading.discard(req_id)
        self._loads_ended(list(output.finished_recving or ()))
        self._failed_loads.update(output.failed_recving or ())
        meta = output.kv_connector_worker_meta
        if not isinstance(meta, PrefixStoreWorkerMeta):
            return
        if meta.costs is not None:
            self.costs = self._waits.apply(meta.costs, wait_clock())
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
                   snapshots: dict[int, Origin], start_at: int = 0) -> SavePlan | None:
        """A save of the request's KV [0, computed) and, on a hybrid model, the states after each
        boundary of ``snapshots`` (0 ignored) whose Mamba block vLLM still holds, each offered with
        its origin: the prompt end, the generation end, a hinted junction, or a state on vLLM's
        block grid (PERIODIC: vLLM's own prefix cache keeps states every block_size tokens)."""
        if not self.saves:
            return None
        if not keyable(request):
            self._stats.count("skipped_requests")
            return None
        if computed < 1:
            return None
        if request.request_id in self._unsaved and not (getattr(request, "kv_transfer_params", None) or {}).get(
                "do_remote_decode"):
            # Not looked up because no load of what it did not hold would pay: nor would a load of
            # what it adds, by the engine most likely to ask for it, the one serving the next turn
            # of its conversation, which holds all but this turn (_no_load_pays). A prefill
            # instance's hand-off is saved whatever it costs.
            self._stats.count("saves_skipped")
            return None
        kept: list[int] = []
        if self.groups.hybrid:
            for t in sorted(snapshots):
                index = self.groups.state_index(t)
                if 0 < t <= computed and all(index < len(block_ids[g]) and block_ids[g][index] != 0
                                             for g, _, _ in self.groups.mamba):
                    kept.append(t)  # else that state block is gone (vLLM keeps only the latest ones)
        # From what earlier saves of the request already copied (the worker rounds down to the
        # store's block): the request-end save of a turn copied its prompt again, 15 ms of the
        # engine's step per 2,239 wide-model tokens, for blocks the store answered "have" to.
        start = max(self._store_start.get(request.request_id, 0), start_at)
        return SavePlan(req_id=request.request_id, save_id=f"{request.request_id}#{next(self._save_ids)}",
                        tokens=list(request.all_token_ids[:computed]), start=min(start, computed),
                        block_ids=tuple(list(b) for b in block_ids), snapshots=tuple(kept),
                        origins={t: int(snapshots[t]) for t in kept}, extra_keys=extra_keys(request), hold=hold)

__all__ = ["DEFERRED_LOOKUP_MAX_S", "PD_PARAMS", "PD_TRUNCATED", "REMEASURE_EVERY", "PrefixStoreScheduler", "common_prefix", "extra_keys", "keyable"]
