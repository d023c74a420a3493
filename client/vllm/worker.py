"""The connector's worker side: the engine's KV views and a staging region, loads on the client's
own event loop while the engine computes (layer by layer on plain models, one batched read on
hybrid ones), saves copied out of the blocks (see client/vllm/connector.py for the whole life of
a request)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import sys
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from ...protocol.namespace import Namespace
from ..client import PrefixClient
from ..heads import head_owners, kv_heads
from ..prompt import Prompt
from .costs import CostFigures, CostMeter
from .loop import ClientLoop
from .layout import TORCH_DTYPES, AttentionLayer, LayoutUnsupported, Payload, StateCodec, VllmKV, learn_cpu_layout
from .plans import CacheGroups, LoadPlan, PrefixStoreMetadata, PrefixStoreWorkerMeta, SavePlan, namespace_for, store_prompt
from .settings import ConnectorSettings
from .stats import RateLimitedLog, StatsBox, decode_step_keys
from .tp import TpGroup, vllm_tp_group

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from prefixstore.gpu_staging.staging import StagingBuffer

log = logging.getLogger(__name__)

#: GPU attention backends that keep a token's K then V at [block, head, slot, :] of vLLM's view.
TOKEN_MAJOR_BACKENDS = frozenset({"FLASH_ATTN", "TRITON_ATTN", "FLEX_ATTENTION"})


SAVE_BUFFERS_KEPT_BYTES = 512 << 20
"""Bytes of save buffers kept for the next saves once theirs ended (the rest are freed)."""


class LoadFailed(Exception):
    pass


class BufferPool:
    """Byte buffers kept from one save to the next. A save copies a request's payloads out of the
    blocks on the engine's thread, into tens of MB that stay busy until its put ends; a fresh
    buffer each time is fresh memory, page-faulted 4 KiB at a time while the engine waits (see
    layout.VllmKV.scratch). Taken on the engine thread, given back on the client loop's."""

    def __init__(self, keep_bytes: int) -> None:
        self._keep_bytes = keep_bytes
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer of at least ``nbytes`` (the smallest kept one that fits, else a new one), as a
        view of exactly ``nbytes``. Tensors are found by identity: ``==`` on tensors compares
        their elements."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes and b.device == device]
            if fits:
                # By position: list.remove compares tensors with ==, elementwise, and raises on
                # buffers of another size ahead of the one taken.
                best = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                return best[:nbytes]
        with torch.inference_mode(False):  # usable on any thread (see layout.VllmKV.scratch)
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def give(self, buf: torch.Tensor) -> None:
        """Keep ``buf`` (a view :meth:`take` returned) for a later save, within the byte bound."""
        base = buf._base if buf._base is not None else buf  # the whole buffer a take sliced
        with self._lock:
            self._free.append(base)
            self._free.sort(key=lambda b: -b.numel())
            kept = 0
            for i, b in enumerate(self._free):
                kept += b.numel()
                if kept > self._keep_bytes:
                    del self._free[i:]
                    break

    @property
    def kept_bytes(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)


class PrefixStoreWorker:
    """Worker-side state: the views, the staging region, the client and its loop, transfers."""

    def __init__(self, vllm_config: VllmConfig, groups: CacheGroups, settings: ConnectorSettings,
                 stats: StatsBox) -> None:
        self._vllm_config = vllm_config
        self.groups: CacheGroups | None = groups
        self.settings = settings
        self._stats = stats
        self._kv: VllmKV | None = None
        self.staging: StagingBuffer | None = None
        self._loop: ClientLoop | None = None
        self.client: PrefixClient | None = None
        """The worker's store client (a documented seam: tests look at its data path)."""
        self._load_lock: asyncio.Lock | None = None
        self._layer_index: dict[str, int] = {}
        self._events: list[threading.Event] | None = None
        self._sync_load: concurrent.futures.Future[dict[str, str]] | None = None
        self._sync_plans: list[LoadPlan] = []
        self._failed_blocks: set[int] = set()
        self._async_loads: list[tuple[LoadPlan, concurrent.futures.Future[dict[str, str]]]] = []
        self._done_sending: set[str] = set()
        self._saves_in_flight: list[concurrent.futures.Future[Any]] = []
        self._releases: list[concurrent.futures.Future[Any]] = []
        """Lease releases of finished loads (a load ends without waiting for them)."""
        self._prepared: concurrent.futures.Future[Any] | None = None  # the data path's set-up (register_kv_caches)
        self._ended_lock = threading.Lock()
        self._saves_ended: list[str] = []
        self.refused: str | None = None
        """Why this worker moves nothing (its views could not be mapped), or None. It still answers
        every plan the scheduler sends (saves dropped, loads failed) and tells the scheduler, which
        then stops planning: the scheduler cannot see the views, and a plan left unanswered holds a
        finished request's blocks and the lookups that wait for its save (issue 29)."""
        self._log = RateLimitedLog(log)
        self._save_buffers = BufferPool(SAVE_BUFFERS_KEPT_BYTES)
        self.costs = CostMeter()
        """What loads and prefill cost on this engine (costs.py), reported to the scheduler."""
        self._costs_sent = CostFigures()
        self._step: tuple[float, int, int, bool] | None = None
        """(started, requests, tokens, load in flight) of the step in progress (begin_step)."""
        self._started: tuple[PrefixStoreMetadata | None, set[int]] = (None, set())
        """(this step's plans, the ids of its loads already started): a load starts once per step."""
        self.tp: TpGroup | None = None
        """This worker's tensor-parallel group (vLLM's, found at registration; a documented seam:
        tests join two workers in one process with their own)."""
        self.heads: tuple[int, int] = (0, 0)
        """The canonical KV heads [start, end) this rank holds (client/heads.py)."""
        self.state_units: tuple[int, int] | None = None
        """The canonical state head units this rank holds; None: an opaque state, moved whole."""

    def drain(self, timeout_s: float | None = None) -> None:
        """Wait for saves and asynchronous loads in flight (shutdown; tests). Their outcomes are
        reported as usual: loads through get_transfer_results, saves in the stats."""
        pending = [*self._saves_in_flight, *(fut for _, fut in self._async_loads), *self._releases]
        concurrent.futures.wait(pending, timeout=timeout_s if timeout_s is not None
                                else 4 * self.settings.client.timeout_s)

    def shutdown(self) -> None:
        if self._loop is not None:
            if self._prepared is not None:
                self._prepared.cancel()  # a set-up still asking a store that does not answer
            self.drain()
            self._loop.close(self.client)
            self._loop = self.client = None

    @property
    def kv(self) -> VllmKV | None:
        """The engine's KV views as the connector moves them (None until registered, or refusing);
        a documented seam: benchmarks time what it does."""
        return self._kv

    def run(self, coro: Any, timeout_s: float | None = None) -> Any:
        """Run ``coro`` on the client's loop and wait for its result (tests and benchmarks drive
        the worker's client with it; the engine never blocks on it)."""
        assert self._loop is not None, "the worker refuses or has no views registered"
        return self._loop.submit(coro).result(timeout=timeout_s)

    def refuse(self, why: str) -> None:
        """Move nothing from now on, answering every plan (see ``refused``)."""
        log.warning("prefixstore connector idle (never loads or saves): %s; it answers what the scheduler "
                    "planned (saves dropped, loads recomputed) and the scheduler stops planning", why)
        self.refused = why
        self._kv = None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take the engine's KV views; allocate the staging region once."""
        if self.groups is None:
            return
        from prefixstore.gpu_staging.staging import StagingBuffer

        groups = self.groups
        ok = True
        try:
            if self.tp is None:
                self.tp = vllm_tp_group(groups.tp_size)
            names = [name for _, group_names, _ in groups.attention for name in group_names]
            token_layout = self._token_layout(names)
            slot_map = (learn_cpu_layout(kv_caches[names[0]], self._cpu_isa(names[0])) if token_layout == "slot_map"
                        else None)
            attention = [AttentionLayer(name=name, view=kv_caches[name], block_size=bs, group=gid,
                                        token_layout=token_layout, slot_map=slot_map)
                         for gid, group_names, bs in groups.attention for name in group_names]
            state = [(gid, kv_caches[name]) for gid, group_names, _ in groups.mamba for name in group_names]
            codec = None
            if groups.hybrid:
                shards = groups.state_shards
                rows = None if shards is None else [shards.canonical_rows(k, groups.tp_size)
                                                    for k in range(len(shards.tensors))]
                codec = StateCodec([(shape, TORCH_DTYPES[dt], tr) for shape, dt, tr in groups.state_tensors], rows)
            kv = VllmKV(attention, state, codec)
            ns = namespace_for(self._vllm_config, groups, self.settings)
            self.heads = kv_heads(self.tp.rank, groups.tp_size, ns.kv.num_heads)
            units = ns.state.num_heads // groups.tp_size if ns.state.num_heads else 0
            self.state_units = (self.tp.rank * units, (self.tp.rank + 1) * units) if units else None
            h = self.heads[1] - self.heads[0]
            if (kv.layer_token_bytes * ns.kv.num_heads != ns.kv.layer_token_bytes * h
                    or kv.snapshot_bytes * (groups.tp_size if units else 1) != ns.state.snapshot_bytes):
                raise LayoutUnsupported("the registered views do not match the KV cache config")
        except (KeyError, LayoutUnsupported, ValueError) as err:
            why, ok = str(err), False
        # Every rank agrees before any moves a byte: a save's slices are gathered (client/vllm/tp.py),
        # so one rank refusing while another saves would leave the other waiting in the gather.
        if self.tp is not None and not self.tp.all_agree(ok) and ok:
            why, ok = "another tensor-parallel rank cannot map its views", False
        if not ok:
            self.refuse(why)
            return
        self._kv = kv
        if self.settings.switch_interval_s > 0:  # the process's, on purpose: the engine thread hands the GIL over
            sys.setswitchinterval(self.settings.switch_interval_s)
        self._layer_index = {layer.name: i for i, layer in enumerate(attention)}
        self.staging = StagingBuffer(self.settings.staging_bytes, attention[0].view.device)
        self._loop = ClientLoop()
        self.client = PrefixClient(ns, self.settings.client)
        # NIXL path (data_path auto/nixl, the store serving it): the staging region is registered with
        # the client's agent once, so every load READs straight into it; a no-op over HTTP.
        self.staging.register_with(self.client)
        # The data path set up now, in the background, not at the first save or load: importing
        # nixl and making the agent take about half a second, and the import holds the GIL long
        # enough to stall the forward passes of the requests then running (PrefixClient.prepare).
        # Not waited on: a store that is down must not hold up the engine's start.
        self._prepared = self._loop.submit(self.client.prepare())

        async def make_lock() -> asyncio.Lock:
            return asyncio.Lock()

        self._load_lock = self._loop.submit(make_lock()).result()

    def _cpu_isa(self, name: str) -> str | None:
        """The ISA vLLM's CPU backend set on this attention layer (its kernel packs blocks by it),
        where the layer says; else None (slot_map.cpu_kernel_write asks vLLM's own choice)."""
        layer = self._vllm_config.compilation_config.static_forward_context.get(name)
        isa = getattr(layer, "isa", None)
        return isa if isinstance(isa, str) else None

    def _token_layout(self, names: Sequence[str]) -> str:
        """Where a token's K and V sit inside a block: fixed by the attention backend, not by vLLM's
        view (layout.py). Unknown backends make the connector idle rather than guess."""
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "slot_map"  # packed per ISA: learned from vLLM's own cache-write kernel
        context = self._vllm_config.compilation_config.static_forward_context
        backends = {context[n].attn_backend.get_name() for n in names
                    if n in context and hasattr(context[n], "attn_backend")}
        if backends and backends <= TOKEN_MAJOR_BACKENDS:
            return "token_major"
        raise LayoutUnsupported(f"attention backend {sorted(backends) or 'unknown'}: its block layout is not "
                                f"known to this connector (known: {sorted(TOKEN_MAJOR_BACKENDS)}, CPU_ATTN)")

    def begin_step(self, meta: PrefixStoreMetadata) -> None:
        """vLLM bound this step's plans, before its forward pass. A decode-only step is timed from
        here to the end of wait_for_save (after the forward), by whether a load is in flight.

        Asynchronous loads into host memory start here, before the forward pass, not after it
        where vLLM 0.32 calls start_load_kv: the load then runs beside this step's forward pass
        (on another core, loop.py) instead of beside the next one's, is more often done by the end
        of this step, and its request is scheduled a step earlier. Safe on the CPU: vLLM zeroes
        new blocks in ``_update_states``, synchronously, before it binds the plans, and the
        forward pass touches only the blocks of scheduled requests, which a request waiting for
        its remote KV is not. On a GPU the zeroing is a kernel queued on the compute stream, so
        loads keep vLLM's order there."""
        loading = any(not fut.done() for _, fut in self._async_loads)
        self._step = (time.perf_counter(), meta.num_reqs, meta.num_tokens, loading) if meta.num_reqs else None
        if self._kv is not None and self._kv.attention[0].view.device.type == "cpu":
            self._start_async_loads(meta)

    def start_load_kv(self, meta: PrefixStoreMetadata | None) -> None:
        """Start this step's loads on the client loop; sync loads release layers one by one. A
        refusing worker fails them at once (vLLM recomputes). vLLM 0.32 calls this before the
        forward pass when the step has sync loads (they feed it), else after it."""
        if meta is None or not meta.loads:
            return
        if self._loop is None:
            for plan in meta.loads:
                self._stats.count("load_failures")
                if plan.is_async:
                    failed: concurrent.futures.Future[dict[str, str]] = concurrent.futures.Future()
                    failed.set_result({plan.req_id: f"connector idle: {self.refused}"})
                    self._async_loads.append((plan, failed))
                else:
                    self._failed_blocks.update(self._blocks_of(plan))
            return
        sync = [p for p in meta.loads if not p.is_async]
        self._start_async_loads(meta)
        if sync:
            assert self._kv is not None
            self._events = [threading.Event() for _ in self._kv.attention]
            self._sync_plans = sync
            self._sync_load = self._loop.submit(self._bounded_load(sync, self._events))

    def _start_async_loads(self, meta: PrefixStoreMetadata) -> None:
        """Start the plan's asynchronous loads on the client loop, each once."""
        if self._loop is None:
            return
        if self._started[0] is not meta:
            self._started = (meta, set())
        started = self._started[1]
        for plan in meta.loads:
            if plan.is_async and id(plan) not in started:
                started.add(id(plan))
                self._async_loads.append((plan, self._loop.submit(self._bounded_load([plan], None))))

    def wait_for_layer_load(self, layer_name: str) -> None:
        index = self._layer_index.get(layer_name)
        if self._events is not None and index is not None:
            self._events[index].wait()

    def wait_for_save(self, meta: PrefixStoreMetadata | None) -> None:
        """Finish this step's sync loads (their failures are reported with this step); copy
        finished requests' payloads out of their blocks and offer them on the client loop. Every
        save is answered in this step: a held request's blocks are released (get_finished) once
        copied, or at once when the copy fails or the worker refuses; its offer and put end within
        ``save_timeout_s``."""
        if self._sync_load is not None:
            failures = self._sync_load.result()
            for plan in self._sync_plans:
                if plan.req_id in failures:
                    self._failed_blocks.update(self._blocks_of(plan))
            self._sync_load, self._events, self._sync_plans = None, None, []
        if self._step is not None:
            started, num_reqs, num_tokens, loading = self._step
            took = time.perf_counter() - started
            if num_tokens == num_reqs:  # a decode-only step
                steps, micros = decode_step_keys(num_reqs, loading)
                self._stats.count(steps)
                self._stats.count(micros, int(took * 1e6))
            if not loading:  # a load beside it would tax it: not the engine's own cost
                self.costs.step(took, num_reqs, num_tokens)
            self._step = None
        if meta is None:
            return
        for save in meta.saves:
            if self._loop is None:
                self._drop_save(save.req_id, save.save_id, f"connector idle: {self.refused}")
            else:
                try:
                    self._start_save(save)
                except Exception as err:  # noqa: BLE001 -- best effort: a save never fails the engine
                    self._drop_save(save.req_id, save.save_id, f"{type(err).__name__}: {err}")
            if save.hold:
                self._done_sending.add(save.req_id)  # its blocks have been copied (or will never be)

    def _drop_save(self, req_id: str, save_id: str, why: str) -> None:
        """A save that will not reach the store: counted (``saves_dropped``), logged, reported ended."""
        self._stats.count("saves_dropped")
        self._log.warning("prefixstore save of %s dropped: %s", req_id, why)
        self._save_ended(save_id)

    def _save_ended(self, save_id: str) -> None:
        with self._ended_lock:  # the client loop adds, the engine thread takes
            self._saves_ended.append(save_id)

    def build_connector_worker_meta(self) -> PrefixStoreWorkerMeta | None:
        """The saves whose offer and put ended since the last step (the scheduler waits for them
        before it looks up a prompt they would lengthen), and whether this worker refuses."""
        with self._ended_lock:
            ended, self._saves_ended = self._saves_ended, []
        costs = self.costs.figures()
        changed = costs != self._costs_sent
        if not ended and self.refused is None and not changed:
            return None
        self._costs_sent = costs
        return PrefixStoreWorkerMeta(saves_done=dict.fromkeys(ended, 1),
                                     refused=[self.refused] if self.refused is not None else [],
                                     costs=costs if changed else None)

    def _blocks_of(self, plan: LoadPlan) -> set[int]:
        """Blocks of the attention groups holding tokens [start, end) of a load."""
        assert self.groups is not None
        out: set[int] = set()
        for gid, _, bs in self.groups.attention:
            out.update(plan.block_ids[gid][plan.start // bs : -(-plan.end // bs)])
        return out

    def get_transfer_results(self, finished_req_ids: set[str], meta: PrefixStoreMetadata | None = None
                             ) -> KVConnectorTransferResults:
        """Saves whose blocks were copied, asynchronous loads that ended. In a step that computes
        nothing (``meta.idle``), first wait up to ``idle_wait_s`` for a load or save in flight to
        end: the engine loop would otherwise spin against them for the GIL."""
        if meta is not None and meta.idle and self.settings.idle_wait_s > 0:
            self._saves_in_flight = [f for f in self._saves_in_flight if not f.done()]
            pending = [*(fut for _, fut in self._async_loads), *self._saves_in_flight]
            if pending:
                concurrent.futures.wait(pending, timeout=self.settings.idle_wait_s,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
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

    async def _bounded_load(self, plans: Sequence[LoadPlan], events: list[threading.Event] | None
                            ) -> dict[str, str]:
        """:meth:`_load`, failed as a whole (vLLM recomputes) past ``load_timeout_s``: a request
        waiting for its remote KV, or a forward pass waiting for a layer, never waits longer."""
        try:
            return await asyncio.wait_for(self._load(plans, events), self.settings.load_timeout_s)
        except asyncio.TimeoutError:
            why = f"not finished after {self.settings.load_timeout_s:g} s (load_timeout_s)"
            for plan in plans:
                self._stats.count("load_failures")
                self._log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id, why)
            return {plan.req_id: why for plan in plans}

    async def _load(self, plans: Sequence[LoadPlan], events: list[threading.Event] | None) -> dict[str, str]:
        """Load every plan; returns req -> why its load failed. Never raises, and always releases
        every layer event.

        Synchronous loads (``events``: plain models, whose attention layers wait for their layer)
        read and write layer by layer, so layer 0 computes while layer 1 loads. An asynchronous
        load (hybrid models: the request waits for the whole load) reads every layer's KV and the
        state in one batched read into the staging region, then writes each layer with a few index
        ops (VllmKV.scatter_payloads). It runs on the client's thread beside vLLM's engine loop,
        which keeps stepping meanwhile, and each hand-off between them (an await that waits, a
        torch op, which lets go of the GIL) can wait up to Python's switch interval for the loop's
        thread to let go: so few hand-offs, not few bytes, is what makes it fast (docs/vllm.md,
        "Loads and the engine loop"): one read instead of one per layer, 2 index ops per layer
        instead of a dozen per 16-token payload and layer, and the lease released after the
        load's result is out."""
        assert self._kv is not None and self._load_lock is not None and self._loop is not None
        failures: dict[str, str] = {}
        num_layers = len(self._kv.attention)
        for plan in plans:
            if plan.commit_wait:  # before the lock: a wait for another instance's commit holds up no other load
                await self._wait_for_commit(plan, failures)
        plans = [p for p in plans if p.req_id not in failures] + [p for p in plans if p.req_id in failures]
        started = time.perf_counter()  # after any commit wait: the meter times the load, not the wait
        try:
            async with self._load_lock:  # one staging region: loads of different steps take turns
                tables = {p.req_id: [np.asarray(ids, dtype=np.int64) for ids in p.block_ids] for p in plans}
                for plan in plans:  # before any layer is released: the forward pass writes after it
                    await self._guarded(plan, failures, self._zero_block_rest(plan, tables[plan.req_id]))
                plans = [plan if plan.req_id in failures else await self._relookup(plan, failures) for plan in plans]
                if events is None:
                    for plan in plans:
                        if plan.req_id not in failures:
                            await self._guarded(plan, failures, self._load_kv(plan, tables[plan.req_id], 0, num_layers,
                                                                              plan.state_index is not None))
                else:
                    for layer in range(num_layers):
                        for plan in plans:
                            if plan.req_id not in failures:
                                await self._guarded(plan, failures, self._load_kv(
                                    plan, tables[plan.req_id], layer, layer + 1,
                                    layer == 0 and plan.state_index is not None))
                        events[layer].set()
                for plan in plans:  # the load's result does not wait for the lease's release
                    self._releases = [f for f in self._releases if not f.done()]
                    self._releases.append(self._loop.submit(self.client.release(plan.lookup.lease_id)))  # type: ignore[union-attr]
        finally:
            if events is not None:
                for event in events:
                    event.set()
        took = time.perf_counter() - started
        for plan in plans:
            if plan.req_id in failures:
                self._stats.count("load_failures")
            else:
                self._stats.count("loaded_tokens", plan.end - plan.start)
        if not failures and events is None:  # an asynchronous load's own time (a sync one shares its step)
            self.costs.load(sum(p.end - p.start for p in plans), took)
        return failures

    def _head_range(self) -> tuple[int, int | None]:
        """The KV heads this rank reads: (0, None) -- every head, the whole payload -- at TP=1."""
        assert self.groups is not None
        return (0, None) if self.groups.tp_size == 1 else self.heads

    async def _relookup(self, plan: LoadPlan, failures: dict[str, str]) -> LoadPlan:
        """The worker's own lookup, leased, before it reads: the scheduler's was lease-free (no side
        effects), and a cluster client reads each entry from the node its own lookup found it on.

        It asks for the planned prefix, tokens [0, end), not the whole prompt: between the two
        lookups another engine's save may have lengthened the match (the next turn of the same
        conversation, saved by another replica), and a lookup of the whole prompt would then
        answer a longer state boundary than the one vLLM allocated for. Asked for [0, end), the
        store answers ``end`` whenever it still holds the planned KV and the snapshot at ``end``.
        A store that lost part of the prefix meanwhile fails the load (vLLM recomputes), never
        serves a shorter one as if it were whole."""
        assert self.client is not None
        lookup = await self.client.lookup(self._planned_prompt(plan), lease=True)
        if not lookup.ok or lookup.kv_tokens < plan.end or (plan.state_index is not None
                                                             and lookup.state_tokens != plan.end):
            failures[plan.req_id] = (f"the store now holds kv={lookup.kv_tokens} state={lookup.state_tokens} "
                                     f"(ok={lookup.ok}) of the planned {plan.end} tokens")
            self._log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id,
                              failures[plan.req_id])
            await self.client.release(lookup.lease_id)
        return dataclasses.replace(plan, lookup=lookup)

    def _planned_prompt(self, plan: LoadPlan) -> Prompt:
        """The store's view of the planned prefix, tokens [0, end), in the connector's keyspace."""
        assert self.client is not None
        tokens = plan.tokens or np.frombuffer(plan.lookup.prompt.tokens(0, plan.end), dtype="<u4").tolist()
        return store_prompt(self.client, self.settings.keys, tokens, plan.lookup.prompt.extra_keys)

    async def _wait_for_commit(self, plan: LoadPlan, failures: dict[str, str]) -> None:
        """A decode instance's load of what its prefill instance said it saved: poll the store
        (lease-free lookups of the planned prefix, every 2 ms growing to 50 ms) until it holds
        the KV and the state the load needs, or ``commit_wait_s`` passes, or a lookup fails (the
        store is down: no point waiting); then the load fails and vLLM recomputes. Outside the
        load lock: other loads go on meanwhile."""
        assert self.client is not None
        prompt = self._planned_prompt(plan)
        started = time.monotonic()
        deadline = started + self.settings.commit_wait_s
        pause = 0.002
        polls = 0
        while True:
            lookup = await self.client.lookup(prompt, lease=False)
            polls += 1
            if lookup.ok and lookup.kv_tokens >= plan.end and (plan.state_index is None
                                                               or lookup.state_tokens == plan.end):
                break
            if not lookup.ok:  # the store cannot be asked: recompute now, not after commit_wait_s
                failures[plan.req_id] = "the store did not answer while waiting for the prefill instance's commit"
                self._log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id,
                                  failures[plan.req_id])
                break
            if time.monotonic() + pause > deadline:
                self._stats.count("commit_wait_timeouts")
                failures[plan.req_id] = (f"the prefill instance's save of {plan.end} tokens was not committed "
                                         f"within commit_wait_s={self.settings.commit_wait_s:g} s")
                self._log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id,
                                  failures[plan.req_id])
                break
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.05)
        self._stats.count("commit_wait_polls", polls)
        self._stats.count("commit_wait_ms", int((time.monotonic() - started) * 1000))

    async def _guarded(self, plan: LoadPlan, failures: dict[str, str], step: Any) -> None:
        try:
            await step
        except Exception as err:  # noqa: BLE001 -- any failure is a miss that vLLM recomputes
            failures[plan.req_id] = f"{type(err).__name__}: {err}"
            self._log.warning("prefixstore load of %s failed, vLLM recomputes it: %s", plan.req_id,
                              failures[plan.req_id])

    async def _zero_block_rest(self, plan: LoadPlan, tables: list[np.ndarray]) -> None:
        """The slots of the load's last attention block past its last token: vLLM leaves zeroing
        a block an asynchronous load fills to the connector (layout.VllmKV.zero_block_rest). Done
        whether the load then succeeds or not; a failed load's blocks vLLM zeroes itself beyond
        the valid prefix (scheduler.py ``_update_waiting_for_remote_kv``)."""
        assert self._kv is not None
        self._kv.zero_block_rest(tables, plan.end)

    async def _load_kv(self, plan: LoadPlan, tables: list[np.ndarray], layer_start: int, layer_end: int,
                       with_state: bool) -> None:
        """Read the KV of layers [layer_start, layer_end) of tokens [plan.start, plan.end) (and, with
        ``with_state``, the snapshot at plan.end) into the staging region in as few reads as it
        holds (one, unless the load is larger than the region), verify, then write them into the
        blocks. Nothing of a read that did not deliver every payload whole is written."""
        assert self._kv is not None and self.staging is not None and self.client is not None
        lookup = plan.lookup
        B = lookup.prompt.block_tokens
        child = lookup.child
        h0, h1 = self._head_range()
        reads = [(item, s, e) for item, s, e in lookup.kv_reads(plan.end, layer_start, layer_end, h0, h1)
                 if e > plan.start]
        payload_tokens = [child.num_tokens if child is not None and item.key == child.key else B
                          for item, _, _ in reads]
        num_layers = layer_end - layer_start
        if reads and max(payload_tokens) * num_layers * self._kv.layer_token_bytes > self.staging.capacity_bytes:
            # One payload of every layer is larger than the region: a layer at a time.
            for layer in range(layer_start, layer_end):
                await self._load_kv(plan, tables, layer, layer + 1, with_state and layer == layer_start)
            return
        items = [item for item, _, _ in reads]
        sizes = [n * num_layers * self._kv.layer_token_bytes for n in payload_tokens]
        if with_state:
            assert self.groups is not None and plan.state_index is not None
            u = self.state_units
            state = lookup.state_read() if u is None or self.groups.tp_size == 1 else lookup.state_read(*u)
            if state is None or lookup.state_tokens != plan.end:
                raise LoadFailed(f"no snapshot at {plan.end}")
            if plan.state_index < 0 or any(plan.block_ids[g][plan.state_index] == 0 for g, _, _ in self.groups.mamba):
                raise LoadFailed("no state block allocated at the boundary")
            items.append(state)
            sizes.append(self._kv.snapshot_bytes)
        for batch in self.staging.rounds(sizes):
            slots = self.staging.carve([sizes[i] for i in batch])
            # NIXL READs land in the device slots; the rest through the host. Zeroes what nothing covered.
            filled = await self.staging.receive(self.client, [items[i] for i in batch], slots)
            if not all(filled):
                raise LoadFailed(f"KV layers [{layer_start}, {layer_end}): {filled.count(False)} of {len(filled)} "
                                 "payloads missing")
            region = self.staging.region
            self._kv.scatter_payloads(region, [Payload(offset=slot.offset, num_tokens=payload_tokens[i],
                                                       token_start=reads[i][1], token_end=reads[i][2])
                                               for i, slot in zip(batch, slots) if i < len(reads)],
                                      layer_start, layer_end, tables, plan.start)
            if with_state and batch[-1] == len(reads):
                assert plan.state_index is not None
                self._kv.scatter_state(region[slots[-1].offset : slots[-1].end], plan.block_ids, plan.state_index)
            self._stats.count("loaded_bytes", sum(s.nbytes for s in slots))

    # ------------------------------------------------------------ saves

    def _start_save(self, plan: SavePlan) -> None:
        """Copy the plan's payloads out of the blocks (now), offer and put them (on the loop).

        A rank copies its own heads (and state units) of every payload; at tensor-parallel size
        t > 1 the slices go to rank 0 in one gather (client/vllm/tp.py), which assembles the
        canonical payloads and saves them, and the other ranks' part of the save ends there."""
        assert self._kv is not None and self._loop is not None and self.client is not None
        assert self.groups is not None and self.tp is not None
        client, kv = self.client, self._kv
        prompt = store_prompt(client, self.settings.keys, plan.tokens, plan.extra_keys)
        T = len(plan.tokens)
        B = prompt.block_tokens
        start = plan.start - plan.start % B
        items = prompt.kv_items(T, start)
        tables = [np.asarray(ids, dtype=np.int64) for ids in plan.block_ids]
        device = kv.attention[0].view.device
        num_layers = len(kv.attention)
        payloads: list[Payload] = []
        pos = 0
        for _, a, b in items:
            payloads.append(Payload(offset=pos, num_tokens=b - a, token_start=a, token_end=b))
            pos += (b - a) * num_layers * kv.layer_token_bytes
        S = kv.snapshot_bytes
        total = pos + S * len(plan.snapshots)
        buf = self._save_buffers.take(total + 1, device)  # the last byte: 1 if this rank copied its slice whole
        host = buf[:total]
        failed: str | None = None
        try:
            kv.gather_payloads(host, payloads, tables)
            for i, t in enumerate(plan.snapshots):
                kv.gather_state(host[pos + i * S : pos + (i + 1) * S], plan.block_ids, self.groups.state_index(t))
            buf[total] = 1
        except Exception as err:  # noqa: BLE001 -- answered below: a dropped save, never a failed step
            failed = f"{type(err).__name__}: {err}"
            buf[total] = 0
        if self.tp.size > 1:
            slices = self.tp.gather(buf)
            if self.tp.rank != 0:
                self._save_buffers.give(buf)
                self._save_ended(plan.save_id)  # this rank's part of the save is its slice
                return
            assert slices is not None
            bad = [r for r, part in enumerate(slices) if int(part[-1]) != 1]
            if bad:
                self._save_buffers.give(buf)
                self._drop_save(plan.req_id, plan.save_id, failed or f"ranks {bad} could not copy their slices")
                return
            full = self._assemble(client.namespace, [part[:-1].cpu().numpy() for part in slices],
                                  [(b - a) for _, a, b in items], len(plan.snapshots))
            self._save_buffers.give(buf)
        elif failed is not None:
            self._save_buffers.give(buf)
            raise LoadFailed(failed)  # wait_for_save drops it
        else:
            full = host.cpu().numpy()
        ns = client.namespace
        offsets: dict[tuple[int, int], tuple[int, int]] = {}
        pos = 0
        for spec, a, b in items:
            offsets[(a, b)] = (pos, pos + spec.size)
            pos += spec.size
        S = ns.state.snapshot_bytes if self.tp.size > 1 else S
        snapshots = {t: full[pos + i * S : pos + (i + 1) * S] for i, t in enumerate(plan.snapshots)}
        keep = buf if self.tp.size == 1 else None  # full views buf's memory at TP=1: given back after the put

        def payload(a: int, b: int) -> Any:
            lo, hi = offsets[(a, b)]
            return full[lo:hi]

        timeout_s = self.settings.save_timeout_s

        async def save() -> None:
            try:
                result = await asyncio.wait_for(client.save(prompt, T, payload, snapshots, start, plan.origins),
                                                timeout_s)
            except asyncio.TimeoutError:
                # Not given back: a transfer cut short may still be reading the buffer.
                self._drop_save(plan.req_id, plan.save_id, f"not finished after {timeout_s:g} s (save_timeout_s)")
                return
            except Exception as err:  # noqa: BLE001 -- the client turns store failures into results; anything else
                self._drop_save(plan.req_id, plan.save_id, f"{type(err).__name__}: {err}")
                return
            if keep is not None:
                self._save_buffers.give(keep)
            self._stats.count("saves")
            self._stats.count("saved_items", result.stored)
            self._stats.count("dropped_items", result.dropped)
            self._stats.count("saved_bytes", result.stored_bytes)
            self._save_ended(plan.save_id)

        self._saves_in_flight = [f for f in self._saves_in_flight if not f.done()]
        self._saves_in_flight.append(self._loop.submit(save()))

    def _assemble(self, ns: Namespace, slices: list[np.ndarray], payload_tokens: list[int],
                  num_snapshots: int) -> np.ndarray:
        """Rank 0 of a save at TP > 1: every rank's slice (its heads of each payload, its state
        units of each snapshot, in the order they were copied) into the canonical payloads, back
        to back: per KV payload ``[layer][K|V][head][token x dim]`` over all heads (a replicated
        head from its first holder), per snapshot ``[layer][tensor][unit]`` over all units."""
        assert self._kv is not None and self.tp is not None
        t = self.tp.size
        num_layers, H, h = len(self._kv.attention), ns.kv.num_heads, self._kv.num_heads
        row = self._kv.attention[0].head_dim * self._kv.attention[0].view.element_size()
        owners = head_owners(t, H)
        heads = [kv_heads(r, t, H) for r in range(t)]
        total = sum(n for n in payload_tokens) * ns.kv.token_bytes + num_snapshots * ns.state.snapshot_bytes
        full = np.empty(total, dtype=np.uint8)
        pos = local = 0
        for n in payload_tokens:
            size, part = n * ns.kv.token_bytes, num_layers * 2 * h * n * row
            dst = full[pos : pos + size].reshape(num_layers, 2, H, n * row)
            for r in range(t):
                if owners[r]:
                    dst[:, :, heads[r][0] : heads[r][1]] = slices[r][local : local + part].reshape(num_layers, 2, h, -1)
            pos, local = pos + size, local + part
        st = ns.state
        local_layer = st.layer_bytes // t
        for _ in range(num_snapshots):
            layers = full[pos : pos + st.snapshot_bytes].reshape(st.num_layers, st.layer_bytes)
            for r in range(t):
                src = slices[r][local : local + st.snapshot_bytes // t].reshape(st.num_layers, local_layer)
                f = lo = 0
                for size in st.tensor_bytes:
                    each = size // t
                    layers[:, f + r * each : f + (r + 1) * each] = src[:, lo : lo + each]
                    f, lo = f + size, lo + each
            pos, local = pos + st.snapshot_bytes, local + st.snapshot_bytes // t
        return full


__all__ = ["LoadFailed", "PrefixStoreWorker", "TOKEN_MAJOR_BACKENDS"]
