"""Admission and eviction policies, retention and the cost model, with an injected logical clock."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import pytest

from prefixstore.admission import (
    Adaptive,
    FlopAware,
    PolicyContext,
    RetentionPlanner,
    SecondHit,
    SightingFilter,
    crossover_tokens,
    get_model,
    make_admission,
    make_eviction,
    optimal_interval,
)
from prefixstore.protocol import Kind, Origin


def key(i: int, kind: Kind = Kind.STATE) -> bytes:
    return bytes((kind,)) + os.urandom(8) + i.to_bytes(8, "little")


def test_sighting_filter_remembers_recent_keys_forgets_old_ones_in_fixed_memory() -> None:
    f = SightingFilter(4096)
    assert f.memory_bytes == 4096
    old = [key(i) for i in range(50)]
    for k in old:
        f.add(k)
    assert all(k in f for k in old)
    for i in range(10 * f.generation_capacity):  # many generations later
        f.add(key(10_000 + i))
    assert sum(k in f for k in old) <= 2  # forgotten (a few false positives at most)
    assert f.memory_bytes == 4096
    fresh = [key(90_000 + i) for i in range(2000)]
    assert sum(k in f for k in fresh) < 0.05 * len(fresh)  # false positives stay rare


def test_second_hit_admits_on_the_second_sighting_only() -> None:
    p = SecondHit(1 << 16)
    k = key(1)
    assert not p.admit(Kind.STATE, k, 10, 0.0)
    assert p.admit(Kind.STATE, k, 10, 1.0)
    j = key(2)
    p.on_sighting(Kind.STATE, j, 2.0)  # a lookup reached this junction: that was the first sighting
    assert p.admit(Kind.STATE, j, 10, 3.0)


def test_adaptive_does_not_collapse_when_every_prefix_is_reused_exactly_twice() -> None:
    p = Adaptive(1 << 16, min_events=16)
    p.always_mode = False  # even starting in second-hit mode
    for i in range(200):
        k = key(i)
        p.admit(Kind.STATE, k, 10, i)  # first sighting
        p.on_evict(Kind.STATE, 0, i)
        p.admit(Kind.STATE, k, 10, i + 0.5)  # second (and last) sighting: second-hit forfeits its only hit
    assert p.always_mode
    assert p.admit(Kind.STATE, key(10_000), 10, 300.0)  # first sightings are admitted again


def test_adaptive_keeps_one_offs_out_under_heavy_tailed_reuse_and_pressure() -> None:
    p = Adaptive(1 << 16, min_events=16)
    hot = [key(i) for i in range(5)]
    t = 0.0
    for k in hot:
        assert p.admit(Kind.STATE, k, 10, t)
    for round_ in range(60):
        for n, k in enumerate(hot):
            p.on_hit(Kind.STATE, k, round_ == 0, t)  # a few prefixes reused again and again
        for _ in range(5):
            p.admit(Kind.STATE, key(1000 + int(t * 10)), 10, t)  # one-offs, never reused
            p.on_evict(Kind.STATE, 0, t)
            t += 0.1
    assert not p.always_mode
    assert not p.admit(Kind.STATE, key(99_999), 10, t)


def test_adaptive_learns_a_dead_origin_and_admits_it_on_second_sighting() -> None:
    p = Adaptive(1 << 16)
    for i in range(40):
        assert p.admit(Kind.STATE, key(i), 10, i, origin=Origin.PROMPT_END) or p.origin_is_dead(Origin.PROMPT_END)
        p.on_evict(Kind.STATE, 0, i, origin=Origin.PROMPT_END)  # left without ever being reused
        k = key(100 + i)
        p.admit(Kind.STATE, k, 10, i, origin=Origin.GENERATION_END)
        p.on_hit(Kind.STATE, k, True, i, origin=Origin.GENERATION_END)
        p.on_evict(Kind.STATE, 1, i, origin=Origin.GENERATION_END)
    assert p.origin_is_dead(Origin.PROMPT_END) and not p.origin_is_dead(Origin.GENERATION_END)
    assert not p.admit(Kind.STATE, key(500), 10, 50.0, origin=Origin.PROMPT_END)
    assert p.admit(Kind.STATE, key(501), 10, 50.0, origin=Origin.GENERATION_END)


def test_adaptive_knows_the_best_origin_from_first_hits_before_its_snapshots_are_evicted() -> None:
    """Long contexts: the junction snapshots that pay stay in the cache for dozens of
    requests, while each question's prompt-end snapshot is evicted unreused. A reused
    snapshot is judged at its first hit, so the one-off origin goes to second sighting
    without waiting for a junction snapshot to be evicted."""
    p = Adaptive(1 << 16)
    for i in range(20):
        k = key(i)
        assert p.admit(Kind.STATE, k, 10, i, origin=Origin.JUNCTION)
        p.on_hit(Kind.STATE, k, True, i, origin=Origin.JUNCTION)  # reused, still held
        p.admit(Kind.STATE, key(100 + i), 10, i, origin=Origin.PROMPT_END)
        p.on_evict(Kind.STATE, 0, i, origin=Origin.PROMPT_END)
    assert p.origin_is_dead(Origin.PROMPT_END) and not p.origin_is_dead(Origin.JUNCTION)
    assert not p.admit(Kind.STATE, key(500), 10, 30.0, origin=Origin.PROMPT_END)
    # Evicting the reused junction snapshots later does not count them twice.
    for i in range(20):
        p.on_evict(Kind.STATE, 3, 40.0 + i, origin=Origin.JUNCTION)
    assert p._reuse_rate(Origin.JUNCTION) == 1.0 and p._evicted[Origin.JUNCTION] == 20


def test_adaptive_judges_an_origin_against_the_best_one_not_an_absolute_rate() -> None:
    """In a small cache every origin is reused rarely. The one that earns the few hits
    there are (prompt ends when each prompt is sent twice: 3% reused before eviction)
    stays admitted on first sight; the one never reused goes to second sighting."""
    p = Adaptive(1 << 16)
    for i in range(200):
        p.admit(Kind.STATE, key(i), 10, i, origin=Origin.PROMPT_END)
        p.on_evict(Kind.STATE, int(i % 33 == 0), i, origin=Origin.PROMPT_END)
        p.admit(Kind.STATE, key(1000 + i), 10, i, origin=Origin.GENERATION_END)
        p.on_evict(Kind.STATE, 0, i, origin=Origin.GENERATION_END)
    assert not p.origin_is_dead(Origin.PROMPT_END) and p.origin_is_dead(Origin.GENERATION_END)
    assert p.admit(Kind.STATE, key(5000), 10, 300.0, origin=Origin.PROMPT_END)
    assert not p.admit(Kind.STATE, key(5001), 10, 300.0, origin=Origin.GENERATION_END)


@dataclass
class FakeEntry:
    """An EntryView: the attributes a policy may read."""

    key: bytes
    kind: Kind
    size: int
    position: int
    num_tokens: int = 0
    namespace_id: bytes = b"ns"
    last_access_s: float = 0.0
    num_hits: int = 0
    origin: int = 0
    parent: bytes | None = None  # blocks: the parent block's hash
    container: bytes | None = None  # snapshots: the store key of the block they hang from

    @property
    def parent_key(self) -> bytes | None:
        """As the store's entries: the parent's store key, scoped by the namespace (store/index.py)."""
        return None if self.parent is None else bytes((Kind.BLOCK,)) + self.namespace_id + self.parent


def test_flop_aware_ranks_long_prefix_snapshots_above_short_ones() -> None:
    shape = get_model("mamba2-hybrid-7b")
    policy = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=1.0, tune=False)
    short = FakeEntry(key(1), Kind.STATE, shape.state_bytes, 500)
    long_ = FakeEntry(key(2), Kind.STATE, shape.state_bytes, 20_000)
    assert policy.priority(long_, 0.0) > policy.priority(short, 0.0)
    lru_like = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.0, tune=False)
    assert lru_like.priority(long_, 0.0) == lru_like.priority(short, 0.0)  # w = 0: recency alone


def test_flop_aware_weight_moves_towards_what_would_have_kept_a_missed_entry() -> None:
    shape = get_model("mamba2-hybrid-7b")
    block_bytes = 16 * shape.kv_bytes_per_token
    p = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
    blocks = [FakeEntry(key(i, Kind.BLOCK), Kind.BLOCK, block_bytes, 16 * (i + 1), 16) for i in range(50)]
    for b in blocks:
        p.on_evict(b, p.priority(b, 0.0), 0.0)
    snap = FakeEntry(key(999), Kind.STATE, shape.state_bytes, 30_000)
    p.on_evict(snap, p.priority(snap, 0.0), 0.0)
    before = p.weight
    p.on_miss(Kind.STATE, snap.key[1:], 1.0)  # an efficient entry was missed: efficiency should weigh more
    assert p.weight > before
    # A short-prefix snapshot (less efficient than the typical victim), missed just after it left:
    # only recency would have kept it.
    q = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
    for b in blocks:
        q.priority(b, 0.0)
        q.on_evict(b, 0.1, 0.0)
    short = FakeEntry(key(998), Kind.STATE, shape.state_bytes, 500)
    q.priority(short, 0.0)
    q.on_evict(short, 0.2, 0.0)
    q.on_miss(Kind.STATE, short.key[1:], 1.0)
    assert q.weight < 0.5


def test_flop_aware_ignores_a_miss_no_weight_could_have_prevented() -> None:
    shape = get_model("mamba2-hybrid-7b")
    p = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
    snap = FakeEntry(key(1), Kind.STATE, shape.state_bytes, 30_000)
    p.priority(snap, 0.0)
    p.on_evict(snap, 1.0, 0.0)
    filler = FakeEntry(key(2, Kind.BLOCK), Kind.BLOCK, 16 * shape.kv_bytes_per_token, 16, 16)
    p.priority(filler, 0.0)
    p.on_evict(filler, 1_000.0, 1.0)  # the inflation moved far past anything w could add
    p.on_miss(Kind.STATE, snap.key[1:], 2.0)
    assert p.weight == 0.5


def test_flop_aware_judges_a_missed_chain_by_the_snapshot_evicted_beneath_it() -> None:
    """Leaf-first eviction peels a chain from its end; the lookup then misses its first
    block, a cheap entry. The mistake was evicting the long-prefix snapshot below it."""
    shape = get_model("mamba2-hybrid-7b")
    block_bytes = 16 * shape.kv_bytes_per_token
    p = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
    for i in range(50):  # the typical victim: a KV block
        b = FakeEntry(key(i, Kind.BLOCK), Kind.BLOCK, block_bytes, 16 * (i + 1), 16)
        p.priority(b, 0.0)
        p.on_evict(b, 0.5, 0.0)
    first, last = key(100, Kind.BLOCK), key(101, Kind.BLOCK)
    chain = [FakeEntry(last, Kind.BLOCK, block_bytes, 30_000, 16, parent=first[1:]),
             FakeEntry(first, Kind.BLOCK, block_bytes, 29_984, 16, parent=os.urandom(16))]
    snap = FakeEntry(key(102), Kind.STATE, shape.state_bytes, 30_000, container=last)
    for e in (snap, *chain):
        p.priority(e, 0.0)
        p.on_evict(e, 1.0, 0.0)
    p.on_miss(Kind.BLOCK, first[1:], 1.0)
    assert p.weight > 0.5
    # Without the snapshot beneath it, the same block miss says the opposite.
    q = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
    for i in range(50):
        b = FakeEntry(key(i, Kind.BLOCK), Kind.BLOCK, block_bytes, 16 * (i + 1000), 16)
        q.priority(b, 0.0)
        q.on_evict(b, 0.5, 0.0)
    lone = FakeEntry(key(103, Kind.BLOCK), Kind.BLOCK, block_bytes, 16, 16, parent=os.urandom(16))
    q.priority(lone, 0.0)
    q.on_evict(lone, 0.5, 0.0)
    q.on_miss(Kind.BLOCK, lone.key[1:], 1.0)
    assert q.weight < 0.5


def test_flop_aware_hits_tell_whether_efficiency_predicts_use() -> None:
    """Hits on the short-prefix snapshots of an origin that stores long ones too (a shared
    system prompt) lower w; hits on its long-prefix ones raise it."""
    shape = get_model("mamba2-hybrid-7b")
    for hit_pos, up in ((400, False), (30_000, True)):
        p = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5)
        for pos in (400, 30_000) * 10:
            p.on_store(FakeEntry(key(pos), Kind.STATE, shape.state_bytes, pos, origin=Origin.JUNCTION), 0.0)
        for _ in range(5):
            p.on_hit(FakeEntry(key(1), Kind.STATE, shape.state_bytes, hit_pos, origin=Origin.JUNCTION, num_hits=1), 1.0)
        assert (p.weight > 0.5) is up and p.weight != 0.5
        w = p.weight
        p.on_hit(FakeEntry(key(2), Kind.STATE, shape.state_bytes, hit_pos, origin=Origin.JUNCTION), 2.0)
        assert p.weight == w  # a first use does not vote: which snapshots live to it is what w decides


def test_flop_aware_early_votes_move_w_further_than_later_ones() -> None:
    """The step shrinks as votes accumulate (K x step first, never below step), so w
    reaches the traffic's side within a few dozen votes and then only follows it."""
    shape = get_model("mamba2-hybrid-7b")
    p = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5, step=0.01, early_votes=10)
    for pos in (400, 30_000) * 10:
        p.on_store(FakeEntry(key(pos), Kind.STATE, shape.state_bytes, pos, origin=Origin.JUNCTION), 0.0)
    moves = []
    for n in range(200):
        up = n % 2 == 0  # alternate, so w stays inside [0, 1] and each move is the full step
        before = p.weight
        p.on_hit(FakeEntry(key(n), Kind.STATE, shape.state_bytes, 30_000 if up else 400,
                           origin=Origin.JUNCTION, num_hits=1), float(n))
        moves.append(abs(p.weight - before))
    assert moves[0] == pytest.approx(0.1)  # K x step
    assert moves[0] > moves[10] > moves[50] > moves[100] - 1e-12
    assert min(moves) == pytest.approx(0.01)  # the base step keeps following the traffic
    fixed = FlopAware(PolicyContext(shape_of=lambda ns: shape), weight=0.5, step=0.01, early_votes=0)
    fixed.on_store(FakeEntry(key(1), Kind.STATE, shape.state_bytes, 400, origin=Origin.JUNCTION), 0.0)
    fixed.on_hit(FakeEntry(key(2), Kind.STATE, shape.state_bytes, 30_000, origin=Origin.JUNCTION, num_hits=1), 1.0)
    assert fixed.weight == pytest.approx(0.51)


def test_policy_registries_name_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        make_admission("sometimes")
    with pytest.raises(ValueError, match="choose one of"):
        make_eviction("random")


def test_retention_boundaries_and_origins() -> None:
    planner = RetentionPlanner(interval=1000)
    plan = planner.plan(prompt_tokens=2500, generated_tokens=600, reused_tokens=1200, hint=1800)
    assert plan == {1800: Origin.JUNCTION, 2000: Origin.PERIODIC, 2500: Origin.PROMPT_END,
                    3000: Origin.PERIODIC, 3099: Origin.GENERATION_END}
    # After decoding N tokens the model has consumed P + N - 1 of them.
    assert RetentionPlanner().plan(100, 1) == {100: Origin.PROMPT_END}
    assert RetentionPlanner().plan(100, 5) == {100: Origin.PROMPT_END, 104: Origin.GENERATION_END}
    assert RetentionPlanner(prompt_end=False).plan(100, 5, reused_tokens=100) == {104: Origin.GENERATION_END}
    with pytest.raises(ValueError, match="interval"):
        RetentionPlanner(interval=-1)


def test_optimal_interval_minimises_the_cost_model() -> None:
    T, S, alpha, beta = 131_072, 48 << 20, 1e-9, 1e-4

    def cost(interval: float) -> float:
        return alpha * S * T / interval + beta * interval / 2

    best = optimal_interval(T, S, alpha, beta)
    grid = min(range(100, 200_000, 50), key=cost)
    assert abs(best - grid) <= 50
    assert math.isclose(optimal_interval(T, S, alpha, beta / 100), 10 * best)  # 100x cheaper recompute: 10x apart
    m = get_model("mamba2-hybrid-7b")
    assert crossover_tokens(m.state_bytes, m.kv_bytes_per_token) == m.state_bytes / m.kv_bytes_per_token
