"""The reference engine loop: one request at a time against a prefix store.

::

    hash     Prompt(tokens[:-1])        the last prompt token is always computed: its logits are the answer's first
    lookup   kv_tokens, state_tokens, checkpoint_hint, a lease
    load     exact:  KV [0, state_tokens) + the snapshot at state_tokens
             replay: KV [0, kv_tokens); the state is rebuilt by replaying the last R tokens from a zero state
             (layer by layer, overlapped with the prefill below; the lease is released once loaded)
    prefill  the rest, in chunks that end exactly at the retention planner's boundaries:
             snapshot = copy of the state before the next chunk extends it
    decode   N tokens greedily; snapshots at decode boundaries (P + N - 1 is the last token consumed)
    save     offer KV [.., P+N-1) and the snapshots; gather and put only what the store wants

The store is best effort: a failed lookup is a miss, a failed load falls back
to recomputing the prefix, a failed save is dropped. A request never fails
because of the store.

Tail-Replay's state is an approximation, and so is all KV computed from it:
such a request offers nothing, so no approximate byte ever lands in the
store under the model's (exact) namespace. Replaying the whole prefix is
exact and saves as usual.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from prefixstore.client import RetentionPlanner
from prefixstore.client.client import PrefixClient
from prefixstore.client.results import LookupResult
from prefixstore.protocol.wire import STATUS_HAVE, STATUS_OK, WANT, ItemResult, ItemSpec
from .loader import LayerwiseLoad, LoadFailed
from .paged_kv import PagedKVCache, SequenceKV
from .reference_model import HybridModel, RecurrentState
from .staging import StagingBuffer

ReuseMode = Literal["exact", "replay", "auto"]
PrefillOutcome = tuple[Tensor, Tensor | None, dict[int, RecurrentState], float]
"""Last prompt token's logits, all computed logits (when asked), snapshots taken, when it finished."""
REUSE_MODES: tuple[ReuseMode, ...] = ("exact", "replay", "auto")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    mode: ReuseMode = "exact"
    """exact: reuse up to state_tokens (KV + snapshot). replay: reuse KV up to kv_tokens and rebuild the
    state by replaying the last R tokens. auto: exact when it recomputes no more tokens than a replay
    would (kv_tokens - state_tokens <= R), else replay."""
    replay_fraction: float = 0.1
    """Tail-Replay budget R as a fraction of the reused prefix (rounded up)."""
    replay_tokens: int = 0
    """Tail-Replay budget R in tokens; overrides replay_fraction when > 0."""
    prefill_chunk_tokens: int = 2048
    """Longest prefill chunk; chunks also end at every planned snapshot boundary."""
    page_tokens: int = 16
    """Engine page size in tokens (independent of the store's block size)."""
    num_pages: int = 2048
    """Pages of the paged KV cache (page_tokens * num_pages tokens per request at most)."""
    staging_bytes: int = 32 << 20
    """Staging region, allocated once; larger transfers go in several rounds."""
    retention: RetentionPlanner = field(default_factory=RetentionPlanner)
    """Which boundaries to snapshot (prompt end, generation end, junction hints, every I tokens)."""

    def __post_init__(self) -> None:
        if self.mode not in REUSE_MODES:
            raise ValueError(f"mode: unknown reuse mode {self.mode!r}; choose one of {list(REUSE_MODES)}")
        if not 0.0 <= self.replay_fraction <= 1.0:
            raise ValueError(f"replay_fraction: must be in [0, 1], got {self.replay_fraction}")
        for name in ("prefill_chunk_tokens", "page_tokens", "num_pages", "staging_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.replay_tokens < 0:
            raise ValueError(f"replay_tokens: must be >= 0, got {self.replay_tokens}")


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """What a request takes from the store: KV [0, kv_tokens), and the state either loaded (exact)
    or rebuilt by replaying ``replay_tokens`` tokens."""

    kv_tokens: int = 0
    load_state: bool = False
    replay_tokens: int = 0

    @property
    def exact(self) -> bool:
        return self.load_state or self.replay_tokens == self.kv_tokens


@dataclass(frozen=True, kw_only=True)
class SaveStats:
    offered: int = 0
    stored: int = 0
    already: int = 0
    rejected: int = 0
    dropped: int = 0
    stored_bytes: int = 0


@dataclass(frozen=True, kw_only=True)
class RequestResult:
    prompt_tokens: int
    generated: list[int]
    logits: Tensor
    """(max_new_tokens, vocab): the logits each generated token was sampled from."""
    prefill_logits: Tensor | None
    """(computed prompt tokens, vocab) when asked for (all_logits=True)."""
    kv_tokens: int
    """The store's answer: KV stored for this prefix (of the prompt less its last token)."""
    state_tokens: int
    checkpoint_hint: int
    plan: ReusePlan
    """What was reused (all zeros after a fallback)."""
    fallback: str | None
    """Why a load was abandoned and the prefix recomputed."""
    computed_tokens: int
    """Prompt tokens run through the model (prefill), replayed ones not included."""
    snapshots: tuple[int, ...]
    """Boundaries whose state was captured."""
    save: SaveStats | None
    loaded_bytes: int
    load_s: float
    """Wall time of the layer-wise load (0 without one)."""
    load_wait_s: float
    """Time compute spent waiting for loaded layers: the load time it did not hide."""
    ttft_s: float
    lookup_s: float
    prefill_s: float
    decode_s: float
    save_s: float

    @property
    def reused_tokens(self) -> int:
        return self.plan.kv_tokens


def _chunk_ends(start: int, end: int, boundaries: Sequence[int], max_chunk: int) -> list[int]:
    """Ends of prefill chunks covering (start, end]: every boundary, and no chunk longer than max_chunk."""
    ends: list[int] = []
    pos = start
    for stop in sorted({b for b in boundaries if start < b < end} | {end}):
        while stop - pos > max_chunk:
            pos += max_chunk
            ends.append(pos)
        ends.append(stop)
        pos = stop
    return ends


class Engine:
    """Runs :class:`HybridModel` requests, reusing and filling the store through ``client``."""

    def __init__(self, model: HybridModel, client: PrefixClient, config: EngineConfig | None = None) -> None:
        self.model, self.client = model, client
        self.config = config = config or EngineConfig()
        ns = client.namespace
        expected = model.config.namespace(block_tokens=ns.block_tokens, tenant=ns.tenant)
        if ns != expected:
            raise ValueError("client namespace: it does not describe this model's KV and state; "
                             "build it with ModelConfig.namespace(block_tokens=...)")
        self.device = next(model.parameters()).device
        self.cache = PagedKVCache.for_model(model.config, num_pages=config.num_pages,
                                            page_tokens=config.page_tokens, device=self.device)
        self.staging = StagingBuffer(config.staging_bytes, self.device)

    # ------------------------------------------------------------ a request

    async def generate(self, tokens: Sequence[int], max_new_tokens: int, *, use_store: bool = True,
                       save: bool = True, all_logits: bool = False) -> RequestResult:
        """Answer one request: greedy decoding of ``max_new_tokens`` tokens after ``tokens``."""
        P, N = len(tokens), max_new_tokens
        if P < 1 or N < 1:
            raise ValueError("a request needs at least one prompt token and one new token")
        started = time.perf_counter()
        lookup = await self.client.lookup(self.client.prompt(tokens[:-1])) if use_store and P > 1 else None
        lookup_s = time.perf_counter() - started
        plan = self._plan(lookup)
        hint = lookup.checkpoint_hint if lookup is not None else 0
        ids = torch.tensor(list(tokens), dtype=torch.long, device=self.device)
        seq = self.cache.sequence()
        seq.reserve(P + N - 1)  # every page the request will use, before loader and compute threads share it
        state = RecurrentState(self.model.config, self.device)
        fallback: str | None = None
        load: LayerwiseLoad | None = None
        try:
            # sorted(): the planner's answer, as token positions (whatever else it carries per boundary).
            boundaries = sorted(self.config.retention.prefill_boundaries(P, plan.kv_tokens, hint)) if plan.exact else []
            outcome: PrefillOutcome | BaseException | None = None
            if plan.kv_tokens and lookup is not None:
                load = LayerwiseLoad(self.client, lookup, kv_tokens=plan.kv_tokens, seq=seq,
                                     state=state if plan.load_state else None, staging=self.staging,
                                     config=self.model.config)
                prefill = asyncio.to_thread(self._prefill, ids, seq, state, plan, boundaries, load.wait_for_layer,
                                            all_logits)
                outcome, _ = await asyncio.gather(prefill, self._load(load, lookup), return_exceptions=True)
                if isinstance(outcome, LoadFailed):  # recompute the prefix: the store is best effort
                    fallback, plan, outcome = str(outcome), ReusePlan(), None
                    state.zero_()
                    boundaries = sorted(self.config.retention.prefill_boundaries(P, 0, hint))
                elif isinstance(outcome, BaseException):
                    raise outcome
            elif lookup is not None:
                await self.client.release(lookup.lease_id)
            if outcome is None:
                outcome = await asyncio.to_thread(self._prefill, ids, seq, state, plan, boundaries, None, all_logits)
            assert outcome is not None and not isinstance(outcome, BaseException)
            last_logits, prefill_logits, snapshots, prefill_done = outcome
            ttft_s = prefill_done - started

            decode_started = time.perf_counter()
            generated, logits = await asyncio.to_thread(self._decode, last_logits, seq, state, P, N, snapshots,
                                                        plan.exact)
            decode_s = time.perf_counter() - decode_started

            save_started = time.perf_counter()
            stats: SaveStats | None = None
            if use_store and save and plan.exact:
                start = lookup.matched_blocks * lookup.prompt.block_tokens if lookup and not fallback else 0
                stats = await self._save(list(tokens) + generated[:-1], seq, snapshots, start)
            save_s = time.perf_counter() - save_started
        finally:
            if load is not None:
                load.cancel("request finished")
            seq.release()
        return RequestResult(
            prompt_tokens=P, generated=generated, logits=logits, prefill_logits=prefill_logits,
            kv_tokens=lookup.kv_tokens if lookup else 0, state_tokens=lookup.state_tokens if lookup else 0,
            checkpoint_hint=hint, plan=plan, fallback=fallback, computed_tokens=P - plan.kv_tokens,
            snapshots=tuple(sorted(snapshots)), save=stats, loaded_bytes=load.loaded_bytes if load else 0,
            load_s=load.load_s if load else 0.0, load_wait_s=load.wait_s if load else 0.0,
            ttft_s=ttft_s, lookup_s=lookup_s, prefill_s=prefill_done - started - lookup_s, decode_s=decode_s,
            save_s=save_s)

    def _plan(self, lookup: LookupResult | None) -> ReusePlan:
        if lookup is None or not lookup.ok:
            return ReusePlan()
        kv, st = lookup.kv_tokens, lookup.state_tokens
        cfg = self.config
        replay = min(kv, cfg.replay_tokens or math.ceil(cfg.replay_fraction * kv))
        if cfg.mode == "exact" or (cfg.mode == "auto" and st and kv - st <= replay):
            return ReusePlan(kv_tokens=st, load_state=True) if st else ReusePlan()
        return ReusePlan(kv_tokens=kv, replay_tokens=replay) if kv else ReusePlan()

    async def _load(self, load: LayerwiseLoad, lookup: LookupResult) -> bool:
        try:
            return await load.run()
        finally:
            await self.client.release(lookup.lease_id)

    # ------------------------------------------------------------ compute (worker thread)

    def _prefill(self, ids: Tensor, seq: SequenceKV, state: RecurrentState, plan: ReusePlan,
                 boundaries: list[int], wait_for_layer: Callable[[int], None] | None, all_logits: bool
                 ) -> PrefillOutcome:
        """Replay (if planned), then prefill [kv_tokens, P) in chunks ending at the boundaries."""
        P, start = ids.shape[0], plan.kv_tokens
        if plan.replay_tokens:
            # Attention layers read the loaded (exact) KV of the replayed positions and do not overwrite it.
            r0 = start - plan.replay_tokens
            self.model(ids[r0:start], start=r0, kv=seq, state=state, before_layer=wait_for_layer, write_kv=False,
                       logits="none")
        snapshots: dict[int, RecurrentState] = {}
        outputs: list[Tensor] = []
        pos = start
        for end in _chunk_ends(start, P, boundaries, self.config.prefill_chunk_tokens):
            out = self.model(ids[pos:end], start=pos, kv=seq, state=state, before_layer=wait_for_layer,
                             logits="all" if all_logits else ("last" if end == P else "none"))
            outputs.append(out)
            if end in boundaries:
                snapshots[end] = state.clone()  # copy before the next chunk extends it
            pos = end
        if all_logits:
            prefill_logits = torch.cat(outputs)
            return prefill_logits[-1], prefill_logits, snapshots, time.perf_counter()
        return outputs[-1], None, snapshots, time.perf_counter()

    def _decode(self, first: Tensor, seq: SequenceKV, state: RecurrentState, P: int, N: int,
                snapshots: dict[int, RecurrentState], capture: bool) -> tuple[list[int], Tensor]:
        boundaries = set(self.config.retention.decode_boundaries(P, N)) if capture else set()
        logits = [first]
        generated = [int(first.argmax())]
        for k in range(1, N):
            token = torch.tensor([generated[-1]], dtype=torch.long, device=self.device)
            out = self.model(token, start=P + k - 1, kv=seq, state=state)
            if P + k in boundaries:  # P + k tokens consumed
                snapshots[P + k] = state.clone()
            logits.append(out)
            generated.append(int(out.argmax()))
        return generated, torch.stack(logits)

    # ------------------------------------------------------------ save

    async def _save(self, consumed: list[int], seq: SequenceKV, snapshots: dict[int, RecurrentState],
                    start: int) -> SaveStats:
        """Offer KV [start, T) and the snapshots of the T consumed tokens; gather and put what is wanted."""
        T = len(consumed)
        prompt = self.client.prompt(consumed)
        kv = prompt.kv_items(T, start)
        bounds = sorted(b for b in snapshots if b <= T)
        specs = [spec for spec, _, _ in kv] + [prompt.state_item(b, T) for b in bounds]
        decisions = await self.client.offer(specs)
        want_kv = [(spec, a, b) for (spec, a, b), d in zip(kv, decisions) if d.status == WANT]
        want_state = [(spec, b) for spec, b, d in zip(specs[len(kv):], bounds, decisions[len(kv):])
                      if d.status == WANT]
        results: list[ItemResult] = []
        cache = self.cache
        for batch in self.staging.rounds([spec.size for spec, _, _ in want_kv]):
            slots = self.staging.carve([want_kv[i][0].size for i in batch])
            rows = self.staging.rows(slots[0], slots[-1], cache.row_elems, cache.data.dtype)
            seq.gather(rows, [(want_kv[i][1], want_kv[i][2]) for i in batch])
            self.staging.to_host(slots)
            results += await self.client.put([(want_kv[i][0], self.staging.host_view(s)) for i, s in zip(batch, slots)])
        if want_state:
            results += await self.client.put([(spec, snapshots[b].payload().numpy()) for spec, b in want_state])
        wanted: list[ItemSpec] = [spec for spec, _, _ in want_kv] + [spec for spec, _ in want_state]
        return SaveStats(
            offered=len(specs),
            stored=sum(r.status == STATUS_OK for r in results),
            already=sum(d.status == STATUS_HAVE for d in decisions) + sum(r.status == STATUS_HAVE for r in results),
            rejected=sum(d.status not in (WANT, STATUS_HAVE) for d in decisions)
            + sum(r.status not in (STATUS_OK, STATUS_HAVE, "dropped") for r in results),
            dropped=sum(r.status == "dropped" for r in results),
            stored_bytes=sum(s.size for s, r in zip(wanted, results) if r.status == STATUS_OK),
        )


def recompute_logits(model: HybridModel, tokens: Sequence[int], *, page_tokens: int = 16,
                     chunk_tokens: int = 2048, all_logits: bool = False) -> Tensor:
    """Full recompute of ``tokens`` with no store: the reference every reuse is compared against.

    Returns the last token's logits ``(vocab,)``, or all ``(n, vocab)``."""
    device = next(model.parameters()).device
    n = len(tokens)
    cache = PagedKVCache.for_model(model.config, num_pages=-(-n // page_tokens), page_tokens=page_tokens,
                                   device=device)
    seq, state = cache.sequence(), RecurrentState(model.config, device)
    ids = torch.tensor(list(tokens), dtype=torch.long, device=device)
    outs = []
    for s in range(0, n, chunk_tokens):
        e = min(n, s + chunk_tokens)
        outs.append(model(ids[s:e], start=s, kv=seq, state=state,
                          logits="all" if all_logits else ("last" if e == n else "none")))
    return torch.cat(outs) if all_logits else outs[-1]


__all__ = ["REUSE_MODES", "Engine", "EngineConfig", "RequestResult", "ReusePlan", "ReuseMode", "SaveStats",
           "recompute_logits"]
