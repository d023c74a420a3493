"""The trace simulator: requests replayed through the store's own index,
admission and eviction code, in-process, with page accounting but no payload
bytes (``Store(virtual_payloads=True)``).

Per request it does what an engine would: hash the prompt, look it up, reuse
``state_tokens`` (exact mode; ``kv_tokens`` for a model without state), then
store the KV of everything the model consumed (prompt + output - 1 tokens)
and the snapshots the retention planner picks. Policies are bundles of store
knobs plus an engine-side retention rule; the baselines are bundles too, so
every number comes from the same code path.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from prefixstore.admission import FlopAware, IntervalTuner, ModelShape, RetentionPlanner, crossover_tokens
from prefixstore.client.prompt import Prompt
from prefixstore.protocol import Kind, KVLayout, Namespace, StateLayout
from prefixstore.protocol.keys import Origin
from prefixstore.client.results import LookupResult
from prefixstore.protocol.wire import WANT, GetItem, ItemSpec, LookupAnswer, LookupRequest
from prefixstore.store import Store, StoreConfig
from .request import Request


@dataclass(frozen=True, kw_only=True)
class SimPolicy:
    """A store policy bundle plus the engine's retention rule."""

    name: str
    description: str
    kv_admission: str = "always"
    state_admission: str = "adaptive"
    eviction: str = "flop-aware"
    interval: int = 0  # periodic snapshots every this many tokens (0: none)
    auto_interval: bool = False  # the interval chosen online by the cost model (IntervalTuner)
    prompt_end: bool = True
    generation_end: bool = True
    junction_hints: bool = True
    engine_page: bool = False  # baseline: KV and snapshots only at page boundaries, page = one state
    bootstrap: bool = False  # baseline: flop-aware weight grid-searched on the trace's start, then frozen


POLICIES: dict[str, SimPolicy] = {p.name: p for p in (
    SimPolicy(name="adaptive", description="the default: adaptive state admission, FLOP-aware eviction tuned "
              "online, snapshots at prompt ends, generation ends, junction hints and every I tokens, I chosen "
              "online from the cost model I* = sqrt(2*T*S*alpha/beta) and the traffic", auto_interval=True),
    SimPolicy(name="always", description="as the default, but admit every snapshot", state_admission="always",
              auto_interval=True),
    SimPolicy(name="second-hit", description="as the default, but admit a snapshot on its second sighting",
              state_admission="second-hit", auto_interval=True),
    SimPolicy(name="lru", description="baseline (b): admit everything, LRU", state_admission="always",
              eviction="lru"),
    SimPolicy(name="marconi", description="baseline (c), after the Marconi paper: snapshots at branch points "
              "(junctions) and sequence ends, FLOP-aware eviction with a weight grid-searched on the first "
              "20% of the trace", state_admission="always", prompt_end=False, bootstrap=True),
    SimPolicy(name="engine-page", description="baseline (a): an engine-style hybrid cache whose page is one "
              "state's worth of tokens; KV and snapshots only at page boundaries, LRU",
              state_admission="always", eviction="lru", prompt_end=False, generation_end=False,
              junction_hints=False, engine_page=True),
)}
DEFAULT_POLICY = "adaptive"


def get_policy(name: str) -> SimPolicy:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}") from None


def namespace_for(model: ModelShape, block_tokens: int) -> Namespace:
    """A namespace whose payload sizes are the model's real ones."""
    state = StateLayout()
    if model.state_bytes:
        state = StateLayout(num_layers=model.num_linear_layers, shapes=((model.state_bytes_per_layer,),), dtype="uint8")
    return Namespace(model=model.name, block_tokens=block_tokens, state=state,
                     kv=KVLayout(num_layers=model.num_attention_layers, num_heads=model.num_kv_heads,
                                 head_dim=model.head_dim, dtype=model.kv_dtype, num_components=model.kv_components))


def engine_page_tokens(model: ModelShape, granule: int = 16) -> int:
    """An engine page as large as one state: the crossover, rounded up to a granule."""
    if not model.state_bytes:
        return granule
    x = crossover_tokens(model.state_bytes, model.kv_bytes_per_token)
    return int(-(-x // granule) * granule)


@dataclass
class SimResult:
    policy: str
    capacity_bytes: int
    num_requests: int = 0
    input_tokens: int = 0
    reused_tokens: int = 0  # exact reuse: state_tokens (kv_tokens without state)
    kv_tokens: int = 0
    state_hits: int = 0  # requests that found a snapshot
    prefill_flops: float = 0.0
    flops_saved: float = 0.0
    bytes_held: dict[str, int] = field(default_factory=dict)
    peak_bytes: int = 0
    eviction_weight: float | None = None
    retention: dict[str, object] | None = None  # the interval tuner's last choice and its inputs
    retention_note: str = ""  # the same, in words
    snapshots: dict[str, dict[str, int]] = field(default_factory=dict)  # by origin: offered, admitted
    seconds: float = 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.reused_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def kv_hit_rate(self) -> float:
        return self.kv_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def state_hit_rate(self) -> float:
        return self.state_hits / self.num_requests if self.num_requests else 0.0

    @property
    def flops_saved_fraction(self) -> float:
        return self.flops_saved / self.prefill_flops if self.prefill_flops else 0.0

    def to_dict(self) -> dict[str, object]:
        d = dataclasses.asdict(self)
        d.update(token_hit_rate=self.token_hit_rate, kv_hit_rate=self.kv_hit_rate,
                 state_hit_rate=self.state_hit_rate, flops_saved_fraction=self.flops_saved_fraction)
        return d


class Simulator:
    def __init__(self, model: ModelShape, capacity_bytes: int, policy: SimPolicy, block_tokens: int = 16,
                 page_bytes: int = 16 << 10, weight: float | None = None) -> None:
        self.model = model
        self.policy = policy
        self.page = engine_page_tokens(model) if policy.engine_page else 0
        self.ns = namespace_for(model, self.page or block_tokens)
        self.now = 0.0
        config = StoreConfig(data_dir="none", ram_bytes=capacity_bytes, page_bytes=min(page_bytes, capacity_bytes),
                             kv_admission=policy.kv_admission, state_admission=policy.state_admission,
                             eviction=policy.eviction, max_items=1 << 20, max_lookup_tokens=1 << 24,
                             max_body_bytes=1 << 62, lease_ttl_s=1.0, pending_ttl_s=1e9)
        self.store = Store(config, clock=lambda: self.now, virtual_payloads=True)
        if weight is not None and isinstance(self.store.eviction, FlopAware):
            self.store.eviction.weight = weight
            self.store.eviction.tune = False
        self.planner = RetentionPlanner(interval=self.page or policy.interval, prompt_end=policy.prompt_end,
                                        generation_end=policy.generation_end, junction_hints=policy.junction_hints)
        self.tuner = IntervalTuner(model.state_bytes, model.kv_bytes_per_token) \
            if policy.auto_interval and model.state_bytes else None
        self._loop = asyncio.new_event_loop()
        self._loop.run_until_complete(self.store.register_namespace(self.ns))
        self.result = SimResult(policy=policy.name, capacity_bytes=capacity_bytes)

    def close(self) -> None:
        self._loop.close()

    def step(self, req: Request) -> int:
        """Replay one request; return the tokens it reused."""
        self.now = req.ts if req.ts is not None else self.now + 1.0
        store, ns, r = self.store, self.ns, self.result
        prompt = Prompt(ns, req.input_tokens)
        P, N = prompt.num_tokens, len(req.output_tokens)
        ans = store.lookup(LookupRequest(namespace_id=ns.id, hashes=b"".join(prompt.hashes), tokens=prompt.packed,
                                         lease=False))
        reused = ans.state_tokens if ns.has_state else ans.kv_tokens
        r.num_requests += 1
        r.input_tokens += P
        r.reused_tokens += reused
        r.kv_tokens += ans.kv_tokens
        r.state_hits += ans.state_tokens > 0
        total = self.model.prefill_flops(P)
        r.prefill_flops += total
        r.flops_saved += self.model.prefill_flops(reused)
        if reused:
            self._read(prompt, ans, reused)

        # What the engine stores: the KV of every token it consumed, and snapshots.
        consumed = P + N - 1 if N else P
        if self.tuner is not None and (interval := self.tuner.interval_for(consumed)) != self.planner.interval:
            self.planner = dataclasses.replace(self.planner, interval=interval)
        full = Prompt(ns, req.input_tokens + req.output_tokens[: max(0, N - 1)]) if N > 1 else prompt
        kv_upto = consumed // self.page * self.page if self.page else consumed
        boundaries = {b: o for b, o in self.planner.plan(P, N, reused, ans.checkpoint_hint).items() if b <= kv_upto}
        B = ns.block_tokens
        start = min(ans.kv_tokens, kv_upto) // B * B
        specs = [s for s, _, _ in full.kv_items(kv_upto, start)]
        if ns.has_state:
            specs += [full.state_item(t, kv_upto, origin) for t, origin in boundaries.items()]
        if specs:
            self._save(specs)
        if self.tuner is not None:
            self.tuner.observe(kv_tokens=ans.kv_tokens, state_tokens=ans.state_tokens, consumed_tokens=consumed)
        held = sum(store.index.stored_bytes.values())
        r.peak_bytes = max(r.peak_bytes, held)
        return reused

    def _read(self, prompt: Prompt, ans: LookupAnswer, reused: int) -> None:
        """Read what is reused, as the engine would (the store's get path, no bytes):
        reads are what eviction counts as use."""
        res = LookupResult(prompt=prompt, kv_tokens=ans.kv_tokens, state_tokens=ans.state_tokens,
                           matched_blocks=ans.matched_blocks, child=ans.child, snapshot=ans.snapshot)
        items = [it for it, _, _ in res.kv_reads(reused)]
        if self.ns.has_state and res.snapshot is not None:
            items.append(GetItem(key=res.snapshot.key))
        plan = self._loop.run_until_complete(self.store.prepare_get(self.ns.id, items))
        self.store.finish_get(plan)

    def _save(self, specs: list[ItemSpec]) -> int:
        """Offer, put what is wanted, commit; return the bytes the store took."""
        store, ns_id = self.store, self.ns.id
        decisions = store.offer(ns_id, specs)
        wanted = [dataclasses.replace(s, checksum=0) for s, d in zip(specs, decisions) if d.status == WANT]
        for s, d in zip(specs, decisions):
            if s.kind is Kind.STATE:
                counts = self.result.snapshots.setdefault(Origin(s.origin).name.lower(), {"offered": 0, "admitted": 0})
                counts["offered"] += 1
                counts["admitted"] += d.status == WANT
        if not wanted:
            return 0
        plan = store.plan_put(ns_id, wanted)
        keys = plan.keys
        if keys:
            self._loop.run_until_complete(store.commit(ns_id, keys))
        return sum(e.size for e in plan.entries if e is not None)

    def finish(self) -> SimResult:
        r = self.result
        r.bytes_held = {f"{k}": v for (k, tier), v in self.store.index.stored_bytes.items() if tier == "ram"}
        ev = self.store.eviction
        r.eviction_weight = ev.weight if isinstance(ev, FlopAware) else None
        if self.tuner is not None:
            choice = self.tuner.choice()
            r.retention, r.retention_note = choice.to_dict(), choice.describe()
        elif self.planner.interval:
            r.retention_note = f"periodic every {self.planner.interval:,} tokens (fixed by the policy)"
        else:
            r.retention_note = "no periodic snapshots (fixed by the policy)"
        return r


def simulate(requests: Sequence[Request], model: ModelShape, capacity_bytes: int, policy: SimPolicy,
             block_tokens: int = 16, progress: Callable[[int, int], None] | None = None) -> SimResult:
    """Replay a whole trace under one policy and capacity."""
    started = time.perf_counter()
    weight = bootstrap_weight(requests, model, capacity_bytes, policy, block_tokens) if policy.bootstrap else None
    sim = Simulator(model, capacity_bytes, policy, block_tokens, weight=weight)
    try:
        for i, req in enumerate(requests):
            sim.step(req)
            if progress is not None and (i + 1) % 100 == 0:
                progress(i + 1, len(requests))
        result = sim.finish()
    finally:
        sim.close()
    result.seconds = time.perf_counter() - started
    return result


BOOTSTRAP_WEIGHTS = (0.0, 0.25, 0.5, 0.75, 1.0)


def bootstrap_weight(requests: Sequence[Request], model: ModelShape, capacity_bytes: int, policy: SimPolicy,
                     block_tokens: int, fraction: float = 0.2) -> float:
    """Marconi-style: replay the first part of the trace once per candidate
    weight and keep the one that saved the most FLOPs (a one-off grid search)."""
    head = requests[: max(1, int(len(requests) * fraction))]
    best, best_saved = BOOTSTRAP_WEIGHTS[0], -1.0
    for w in BOOTSTRAP_WEIGHTS:
        sim = Simulator(model, capacity_bytes, policy, block_tokens, weight=w)
        try:
            for req in head:
                sim.step(req)
            saved = sim.result.flops_saved
        finally:
            sim.close()
        if saved > best_saved:
            best, best_saved = w, saved
    return best


__all__ = ["DEFAULT_POLICY", "POLICIES", "SimPolicy", "SimResult", "Simulator", "get_policy", "simulate", "Kind"]
