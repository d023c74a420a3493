"""FLOP-aware eviction's arithmetic pinned to exact values: the priority formula, the running
mean behind E, the weight's bounds, origin values' decay, what an entry hangs from.
Written against the survivors of a mutation run (docs/testing.md)."""

from __future__ import annotations

import pytest

from prefixstore.admission import FlopAware, ModelShape, PolicyContext, get_model
from prefixstore.admission.eviction import OriginValue, anchor_key, flops_saved
from prefixstore.protocol import Kind
from prefixstore.protocol.keys import Origin

from .test_policies import FakeEntry, key

SHAPE = get_model("mamba2-hybrid-7b")


def policy(**kw: object) -> FlopAware:
    return FlopAware(PolicyContext(shape_of=lambda ns: SHAPE), **kw)  # type: ignore[arg-type]


def test_policy_context_defaults_to_a_mebibyte_of_filter_and_no_shapes() -> None:
    ctx = PolicyContext()
    assert ctx.filter_bytes == 1 << 20 and ctx.shape_of(b"any") is None


def test_priority_is_inflation_plus_value_times_the_weighted_efficiency() -> None:
    p = policy(weight=0.25, tune=False)
    a = FakeEntry(key(1), Kind.STATE, SHAPE.state_bytes, 1000)
    b = FakeEntry(key(2), Kind.STATE, SHAPE.state_bytes, 3000)
    eff_a = flops_saved(SHAPE, a) / a.size
    eff_b = flops_saved(SHAPE, b) / b.size
    assert p.efficiency(a) == pytest.approx(1.0)  # the running mean starts at the first entry
    e_b = p.efficiency(b)
    assert e_b == pytest.approx(eff_b / ((eff_a + eff_b) / 2))  # then the mean of the two
    p.inflation = 10.0
    e = p.efficiency(a)  # the third sample moves the mean again
    mean = (eff_a + eff_b + eff_a) / 3
    assert e == pytest.approx(eff_a / mean)
    # priority = L + V * ((1 - w) + w * E), E from a 4th sample
    p.origins.on_store(Origin.UNKNOWN)
    v = p.value(b)
    assert v == 1.0  # its origin is the only one seen: the best
    assert p.priority(b, 0.0) == pytest.approx(10.0 + 0.75 + 0.25 * (eff_b / ((2 * eff_a + 2 * eff_b) / 4)))


def test_weight_stays_within_zero_and_one() -> None:
    p = policy(weight=0.05, step=0.5, early_votes=0)
    short = FakeEntry(key(1), Kind.STATE, SHAPE.state_bytes, 500, origin=Origin.JUNCTION)
    long_ = FakeEntry(key(2), Kind.STATE, SHAPE.state_bytes, 30_000, origin=Origin.JUNCTION)
    p.on_store(long_, 0.0)
    p.on_store(short, 0.0)
    for _ in range(5):  # repeat hits on the short (less efficient) snapshot: votes for w -> 0
        short.num_hits = 1
        p.on_hit(short, 0.0)
    assert p.weight == 0.0
    for _ in range(5):
        long_.num_hits = 1
        p.on_hit(long_, 0.0)
    assert p.weight == 1.0


def test_a_kv_hit_is_no_snapshot_origins_first_hit() -> None:
    p = policy(tune=False)
    block = FakeEntry(key(1), Kind.BLOCK, 16 * SHAPE.kv_bytes_per_token, 16, num_tokens=16)
    p.on_store(block, 0.0)
    p.on_hit(block, 0.0)
    assert p.origins.reused == {}
    snap = FakeEntry(key(2), Kind.STATE, SHAPE.state_bytes, 16, origin=Origin.PROMPT_END)
    p.on_store(snap, 0.0)
    p.on_hit(snap, 0.0)
    assert p.origins.reused == {Origin.PROMPT_END: 1.0}


def test_origin_counts_halve_every_half_life_stores() -> None:
    v = OriginValue(half_life=4)
    for _ in range(3):
        v.on_store(Origin.PROMPT_END)
    v.on_first_hit(Origin.PROMPT_END)
    assert v.stored == {Origin.PROMPT_END: 3.0}
    v.on_store(Origin.PROMPT_END)  # the 4th: both counts halve
    assert v.stored == {Origin.PROMPT_END: 2.0} and v.reused == {Origin.PROMPT_END: 0.5}


def test_an_entry_hangs_from_its_container_or_its_parent_block() -> None:
    snap = FakeEntry(key(1), Kind.STATE, 16, 8, container=b"\x01" + b"c" * 16)
    block = FakeEntry(key(2), Kind.BLOCK, 64, 8, num_tokens=4, parent=b"p" * 16)
    first = FakeEntry(key(3), Kind.BLOCK, 64, 4, num_tokens=4, parent=None)
    assert anchor_key(snap) == b"\x01" + b"c" * 16
    assert anchor_key(block) == bytes((Kind.BLOCK,)) + b"ns" + b"p" * 16  # scoped by its namespace
    assert anchor_key(first) is None


def test_efficiency_is_per_byte_whatever_the_entry_size() -> None:
    """A KV block and a snapshot of different sizes: E compares FLOPs saved per byte held."""
    p = policy(tune=False)
    block = FakeEntry(key(1), Kind.BLOCK, 16 * SHAPE.kv_bytes_per_token, 1016, num_tokens=16)
    snap = FakeEntry(key(2), Kind.STATE, SHAPE.state_bytes, 1000)
    per_byte = [flops_saved(SHAPE, e) / e.size for e in (block, snap)]
    assert p.efficiency(block) == pytest.approx(1.0)
    assert p.efficiency(snap) == pytest.approx(per_byte[1] / (sum(per_byte) / 2))


def test_a_repeat_kv_hit_does_not_vote_on_the_weight() -> None:
    p = policy(weight=0.5)
    snap = FakeEntry(key(1), Kind.STATE, SHAPE.state_bytes, 5000)  # origin 0: what this origin stores
    p.on_store(snap, 0.0)
    block = FakeEntry(key(2), Kind.BLOCK, 16 * SHAPE.kv_bytes_per_token, 16, num_tokens=16, num_hits=3)
    p.on_hit(block, 0.0)
    assert p.weight == 0.5 and p.votes == 0


def test_kv_keeps_value_one_whatever_the_origins_learned() -> None:
    p = policy(tune=False)
    for _ in range(40):  # snapshots of the prompt-end origin, never reused: a low value
        p.origins.on_store(Origin.PROMPT_END)
    p.origins.on_store(Origin.JUNCTION)
    p.origins.on_first_hit(Origin.JUNCTION)
    block = FakeEntry(key(1), Kind.BLOCK, 16 * SHAPE.kv_bytes_per_token, 16, num_tokens=16, origin=Origin.PROMPT_END)
    tail = FakeEntry(key(2), Kind.TAIL, 4 * SHAPE.kv_bytes_per_token, 20, num_tokens=4, origin=Origin.PROMPT_END)
    snap = FakeEntry(key(3), Kind.STATE, SHAPE.state_bytes, 16, origin=Origin.PROMPT_END)
    assert p.value(block) == p.value(tail) == 1.0 > p.value(snap)


def test_a_first_hit_does_not_vote_on_the_weight() -> None:
    p = policy(weight=0.5)
    snap = FakeEntry(key(1), Kind.STATE, SHAPE.state_bytes, 30_000, origin=Origin.JUNCTION)
    p.on_store(FakeEntry(key(2), Kind.STATE, SHAPE.state_bytes, 500, origin=Origin.JUNCTION), 0.0)
    p.on_store(snap, 0.0)
    p.on_hit(snap, 0.0)  # num_hits == 0: its first use
    assert p.weight == 0.5 and p.votes == 0
    snap.num_hits = 1
    p.on_hit(snap, 0.0)  # a repeat use votes
    assert p.weight > 0.5 and p.votes == 1


# ---------------------------------------------------------------- the weight's tuner
# Written against the survivors of a seeded mutation sample of admission/eviction.py
# (docs/testing.md): the step schedule, the per-origin mean a repeat use is judged by, how far
# a different w could have reached, which ghost a chain leaves, and how a miss is weighed.


def snap(i: int, position: int, origin: int = Origin.JUNCTION, container: bytes | None = None) -> FakeEntry:
    return FakeEntry(key(i), Kind.STATE, SHAPE.state_bytes, position, origin=origin, container=container)


def eff(entry: FakeEntry) -> float:
    return flops_saved(SHAPE, entry) / entry.size


def test_the_step_shrinks_as_one_over_one_plus_n_over_k_down_to_the_base_step() -> None:
    """The module docstring's schedule with the default K = 10: the n-th vote (from 0) moves w by
    step x max(1, K / (1 + n/K)), so 10 steps at first, 6.67 at the 6th vote, and the base step
    from the 91st on (K(K - 1) = 90 votes)."""
    p = policy(weight=0.0, step=0.001)
    short, long_ = snap(1, 500), snap(2, 30_000)
    p.on_store(short, 0.0)
    p.on_store(long_, 0.0)
    long_.num_hits = 1  # repeat uses of the more efficient snapshot: each raises w
    weights = [p.weight]
    for _ in range(100):
        p.on_hit(long_, 0.0)
        weights.append(p.weight)
    deltas = [b - a for a, b in zip(weights, weights[1:])]
    expected = [0.001 * max(1.0, 10 / (1 + n / 10)) for n in range(100)]
    assert deltas == pytest.approx(expected, rel=1e-9)
    assert deltas[0] == pytest.approx(0.01) and deltas[5] == pytest.approx(0.001 * 10 / 1.5)
    assert deltas[89] > 0.001 and deltas[90] == pytest.approx(0.001)
    assert p.votes == 100


@pytest.mark.parametrize(("position", "raises"), [(3000, False), (2000, False), (4000, True)])
def test_a_repeat_use_raises_w_only_when_more_efficient_than_what_its_origin_stores(position: int,
                                                                                   raises: bool) -> None:
    """The origin stored one snapshot (at 3000 tokens), so what it typically stores is that
    snapshot's efficiency, exactly. A repeat use of a snapshot as efficient (the same one) or
    less (2000 tokens: two thirds of it) lowers w; a more efficient one (4000) raises it."""
    p = policy(weight=0.5, step=0.01, early_votes=0)
    p.on_store(snap(1, 3000), 0.0)
    used = snap(2, position)
    assert (eff(used) > eff(snap(1, 3000))) is raises
    used.num_hits = 1
    p.on_hit(used, 0.0)
    assert p.weight == pytest.approx(0.51 if raises else 0.49)


def test_a_snapshot_of_no_known_shape_counts_as_saving_nothing_in_its_origins_typical_efficiency() -> None:
    """One namespace has a shape, one has none; both store a junction snapshot (3,000 tokens). What
    the origin typically stores is their mean, the shaped one's FLOPs per byte and 0 (nothing known
    to be saved): half the first. A repeat use of a shaped snapshot at exactly that half (the same
    prefix in twice the bytes) is a tie, and a tie lowers w."""
    p = FlopAware(PolicyContext(shape_of=lambda ns: SHAPE if ns == b"ns" else None),
                  weight=0.5, step=0.01, early_votes=0)
    p.on_store(snap(1, 3000), 0.0)
    p.on_store(FakeEntry(key(2), Kind.STATE, S, 3000, namespace_id=b"unknown", origin=Origin.JUNCTION), 0.0)
    half = FakeEntry(key(3), Kind.STATE, 2 * S, 3000, origin=Origin.JUNCTION, num_hits=1)
    assert eff(half) == eff(snap(1, 3000)) / 2
    p.on_hit(half, 0.0)
    assert p.votes == 1 and p.weight == pytest.approx(0.49)


@pytest.mark.parametrize("position", [4000, 2000])  # more efficient than the mean (w -> 1 helps), less (w -> 0)
@pytest.mark.parametrize("beyond", [False, True])
def test_a_miss_counts_only_within_what_a_different_weight_could_have_added(position: int, beyond: bool) -> None:
    """A ghost evicted at priority 10: a different w in [0, 1] could have added at most V x (1 - w)
    x (E - 1) to its priority when E > 1, V x w x (1 - E) when E < 1. A miss after the inflation
    grew by a bit less votes; a bit more, and no w could have kept it: no vote."""
    p = policy(weight=0.5, step=0.01, early_votes=0)
    p.origins.on_store(Origin.JUNCTION)  # the only origin seen: V = 1
    ref = snap(1, 3000)
    assert p.efficiency(ref) == 1.0  # the running mean of E is this snapshot's efficiency
    x = snap(2, position)
    e = eff(x) / eff(ref)
    reach = (1 - 0.5) * (e - 1) if e > 1 else 0.5 * (1 - e)
    assert 0.1 < reach < 0.25
    p.on_evict(x, 10.0, 0.0)
    p.inflation = 10.0 + (reach + 0.05 if beyond else reach - 0.05)
    p.on_miss(Kind.STATE, x.key[1:], 0.0)
    assert p.votes == (0 if beyond else 1)
    assert p.weight != 0.5 or beyond


def test_entries_without_a_model_shape_are_evicted_and_missed() -> None:
    """No shape for the namespace (nothing to compute FLOPs from): E is 1, the eviction and a
    later miss on the entry go through without an efficiency to divide by, and the miss, of no
    known cost, weighs one step."""
    p = FlopAware(PolicyContext(), weight=0.5, step=0.01, early_votes=0)
    s = snap(1, 3000)
    p.on_store(s, 0.0)
    assert p.priority(s, 0.0) == pytest.approx(1.0)  # L = 0, V = 1, E = 1
    p.on_evict(s, 1.0, 0.0)
    p.on_miss(Kind.STATE, s.key[1:], 0.0)
    assert p.inflation == 1.0 and p.votes == 1 and abs(p.weight - 0.5) == pytest.approx(0.01)


def test_e_is_relative_whatever_the_units_of_flops_per_byte() -> None:
    """A shape that saves far less than one FLOP per byte held (a tiny model, a huge state):
    E is still each entry's efficiency over the running mean, as for a 7B model."""
    tiny = ModelShape(name="tiny", hidden_size=1, num_attention_layers=0, num_linear_layers=1, num_kv_heads=1,
                      head_dim=1, state_bytes_per_layer=1 << 30, linear_flops_per_token=1)
    p = FlopAware(PolicyContext(shape_of=lambda ns: tiny), tune=False)
    a = FakeEntry(key(1), Kind.STATE, tiny.state_bytes, 1000)
    b = FakeEntry(key(2), Kind.STATE, tiny.state_bytes, 3000)
    per_byte = [flops_saved(tiny, e) / e.size for e in (a, b)]
    assert per_byte[1] < 1.0
    assert p.efficiency(a) == 1.0
    assert p.efficiency(b) == pytest.approx(per_byte[1] / (sum(per_byte) / 2))  # 1.5


def test_kv_stores_are_no_snapshot_origins_and_only_a_first_use_counts_as_reuse() -> None:
    """V is the share of an origin's snapshots that got reused at all: KV stored beside them
    counts toward no origin, and a snapshot used three times is one reused snapshot."""
    p = policy(tune=False)
    for i in range(5):
        p.on_store(block(i), 0.0)
    assert p.origins.stored == {}
    s = snap(10, 3000, Origin.PROMPT_END)
    p.on_store(s, 0.0)
    for hits in range(3):
        s.num_hits = hits  # the store counts a hit after telling the policy
        p.on_hit(s, 0.0)
    assert p.origins.stored == {Origin.PROMPT_END: 1.0} and p.origins.reused == {Origin.PROMPT_END: 1.0}


def test_the_last_num_ghosts_evictions_are_remembered() -> None:
    """num_ghosts = 2 and three evictions: a miss on the oldest says nothing (forgotten), misses
    on the two others vote."""
    p = policy(weight=0.5, step=0.01, early_votes=0, num_ghosts=2)
    gone = [snap(i, 3000) for i in range(3)]
    for s in gone:
        p.on_evict(s, 0.0, 0.0)
    p.on_miss(Kind.STATE, gone[0].key[1:], 0.0)
    assert p.votes == 0
    p.on_miss(Kind.STATE, gone[1].key[1:], 0.0)
    p.on_miss(Kind.STATE, gone[2].key[1:], 0.0)
    assert p.votes == 2


def test_by_default_the_last_8192_evictions_are_remembered() -> None:
    """The default num_ghosts: 8,193 evictions forget the first (a miss on it neither votes nor
    counts as bytes asked for again) and keep the second."""
    p = policy(weight=0.5, step=0.01, early_votes=0)
    gone = [snap(i, 3000) for i in range(8193)]
    for s in gone:
        p.on_evict(s, 0.0, 0.0)
    p.on_miss(Kind.STATE, gone[0].key[1:], 0.0)
    assert p.votes == 0 and p.evicted_reuse == 0.0
    p.on_miss(Kind.STATE, gone[1].key[1:], 0.0)
    assert p.votes == 1 and p.evicted_reuse > 0.0


def chain_policy(**kw: object) -> FlopAware:
    """A tuner whose typical victim (the frontier) is a snapshot of 4,400 tokens: between a KV
    block's efficiency and a 6,000-token snapshot's, so a miss judged as the block lowers w and
    one judged as that snapshot raises it."""
    p = policy(weight=0.5, step=0.01, early_votes=0, **kw)
    p.on_evict(snap(90, 4400), 0.0, 0.0)  # no container: it carries nothing up
    return p


def block(i: int) -> FakeEntry:
    return FakeEntry(key(i, Kind.BLOCK), Kind.BLOCK, 16 * SHAPE.kv_bytes_per_token, 16, num_tokens=16)


@pytest.mark.parametrize("junction_first", [False, True])
def test_a_chain_is_judged_by_the_most_valuable_snapshot_evicted_beneath_it(junction_first: bool) -> None:
    """Under one block: a long prompt-end snapshot (an origin never reused: V x FLOPs per byte
    small, though its FLOPs per byte are the highest) leaves first, at priority 0, then a junction
    snapshot (reused: V = 1) at 5, then the block at 5. The miss on the block is judged as the
    junction snapshot: inside the reach (evicted at today's inflation) and more efficient than the
    frontier, so w rises. Judged as the prompt end it would not count (evicted long before), as
    the block itself w would fall."""
    p = chain_policy()
    parent = block(10)
    prompt_end = snap(11, 20_000, Origin.PROMPT_END, container=parent.key)
    junction = snap(12, 6000, Origin.JUNCTION, container=parent.key)
    for _ in range(40):
        p.origins.on_store(Origin.PROMPT_END)
    p.on_store(prompt_end, 0.0)
    p.on_store(junction, 0.0)
    p.on_hit(junction, 0.0)  # its first use: the junction origin's value
    assert eff(prompt_end) > eff(junction) > eff(parent)
    assert p.value(prompt_end) * eff(prompt_end) < p.value(junction) * eff(junction)  # V x FLOPs per byte
    # Either order: the carry keeps the higher V x FLOPs per byte, not the latest.
    for s, at in ([(junction, 5.0), (prompt_end, 0.0)] if junction_first else [(prompt_end, 0.0), (junction, 5.0)]):
        p.on_evict(s, at, 0.0)
    p.on_evict(parent, 5.0, 0.0)
    p.on_miss(Kind.BLOCK, parent.key[1:], 0.0)
    assert p.votes == 1 and p.weight == pytest.approx(0.51)


def test_a_chain_whose_snapshot_beneath_is_worth_less_than_its_block_is_judged_as_the_block() -> None:
    """A 1,000-token snapshot under a block: fewer FLOPs per byte than the block (V at most 1),
    so the block's ghost keeps its own figures; the carry is taken only when it is worth more.
    The typical victim (a 2,000-token snapshot) lies between the two: the miss on the block,
    judged as the block, raises w (judged as the snapshot it would lower it)."""
    p = policy(weight=0.5, step=0.01, early_votes=0)
    p.on_evict(snap(90, 2000), 0.0, 0.0)  # the frontier; no container
    parent = block(10)
    beneath = snap(11, 1000, container=parent.key)
    assert eff(beneath) < eff(snap(90, 2000)) < eff(parent)
    assert p.value(beneath) * eff(beneath) < eff(parent)
    p.on_evict(beneath, 0.0, 0.0)
    p.on_evict(parent, 0.0, 0.0)
    p.on_miss(Kind.BLOCK, parent.key[1:], 0.0)
    assert p.votes == 1 and p.weight == pytest.approx(0.51)


def test_ghosts_carried_up_are_kept_for_the_num_ghosts_parents_touched_last() -> None:
    """num_ghosts = 2: three parents each carry the snapshot evicted beneath them, so the carry
    forgets the parent touched longest ago. The two others, evicted and missed, are judged as
    their snapshots (more efficient than the frontier: w rises); the first as itself (a KV
    block: w falls)."""
    p = chain_policy(num_ghosts=2)
    parents = [block(10), block(20), block(30)]
    snaps = [snap(11 + i, 6000, container=b.key) for i, b in enumerate(parents)]
    for s in snaps:
        p.on_store(s, 0.0)  # the junction origin, the only one stored: V = 1
    assert p.value(snaps[0]) * eff(snaps[0]) > eff(parents[0])  # what a parent carries outranks it
    for s in snaps:
        p.on_evict(s, 5.0, 0.0)
    weights = []
    for b in reversed(parents):  # the last touched first
        p.on_evict(b, 5.0, 0.0)
        p.on_miss(Kind.BLOCK, b.key[1:], 0.0)
        weights.append(p.weight)
    # (The last miss lowers w by less than a step: a block's miss costs far less than the
    # snapshots' misses before it, and misses are weighed by their cost.)
    assert p.votes == 3 and weights[:2] == pytest.approx([0.51, 0.52]) and weights[2] < weights[1]


@pytest.mark.parametrize("frontier", [None, 30_000])
@pytest.mark.parametrize(("position", "steps"), [(2000, (1.9, 2.0)), (20_000, (4.0, 4.0))])
def test_a_miss_moves_w_by_its_cost_over_the_typical_misses_at_most_four_steps(
        position: int, steps: tuple[float, float], frontier: int | None) -> None:
    """Two misses, each inside the reach. The first sets the typical cost: one step. The second
    cost about twice as much (a 2,000-token snapshot after a 1,000-token one): about two steps
    (a little less, as the running mean moved towards it); 400 times as much: four, the cap.
    The same whether the misses raise w or (behind a frontier of 30,000-token snapshots, more
    efficient than both) lower it."""
    p = policy(weight=0.5, step=0.01, early_votes=0)
    if frontier is not None:
        p.on_evict(snap(9, frontier), 0.0, 0.0)
    cheap, costly = snap(1, 1000), snap(2, position)
    p.on_evict(cheap, 0.0, 0.0)
    p.on_evict(costly, 0.0, 0.0)
    p.on_miss(Kind.STATE, cheap.key[1:], 0.0)
    after_first = p.weight
    assert abs(after_first - 0.5) == pytest.approx(0.01)
    p.on_miss(Kind.STATE, costly.key[1:], 0.0)
    moved = abs(p.weight - after_first) / 0.01
    assert (p.weight < after_first) is (frontier is not None)
    assert p.votes == 2 and steps[0] - 1e-9 <= moved <= steps[1] + 1e-9
    # The typical cost is a running mean over about 64 misses, seeded by the first.
    f1, f2 = flops_saved(SHAPE, cheap), flops_saved(SHAPE, costly)
    assert moved == pytest.approx(min(4.0, f2 / (f1 + (f2 - f1) / 64)))


@pytest.mark.parametrize("raise_w", [True, False])
def test_a_miss_keeps_the_weight_within_zero_and_one(raise_w: bool) -> None:
    """A four-step miss next to a bound: w stops at 1 (raised) or 0 (lowered)."""
    p = policy(weight=0.99 if raise_w else 0.01, step=0.5, early_votes=0)
    low, high = snap(1, 1000), snap(2, 20_000)
    p.on_evict(low, 0.0, 0.0)  # the frontier: the first victim, then a 64th of the way to the second
    p.on_evict(high, 0.0, 0.0)
    p.on_miss(Kind.STATE, (high if raise_w else low).key[1:], 0.0)
    assert p.votes == 1 and p.weight == (1.0 if raise_w else 0.0)


# Priced renewals (issue 18): y, the share of evicted bytes asked for again, prices a snapshot's
# bytes; a use renews a snapshot, and counts as its origin's reuse, by the share of that price
# it pays.

KV = SHAPE.kv_bytes_per_token
S = SHAPE.state_bytes


def priced(y_half: bool = False, **kw: object) -> FlopAware:
    """A policy whose y is 1 (one block evicted and asked for again) or 1/2 (two equal
    blocks evicted, one asked for again), evicted at once so nothing has decayed yet."""
    p = policy(**kw)
    gone = [block(900), block(901)] if y_half else [block(900)]
    for b in gone:
        p.on_evict(b, 0.0, 0.0)
    p.on_miss(Kind.BLOCK, gone[0].key[1:], 0.0)
    f = 0.5 ** (1 / p.half_life)
    assert p.evicted_reuse == pytest.approx(1 / (1 + f) if y_half else 1.0)
    return p


@pytest.mark.parametrize("tune", [True, False])
def test_y_is_the_share_of_evicted_bytes_asked_for_again_with_what_hung_beneath(tune: bool) -> None:
    """y = bytes asked for again per byte evicted, tuned w or not (it is the traffic's): 0 before
    any eviction and while nobody asks for what left. A miss on a block counts the block and the
    snapshot evicted beneath it (a lookup that misses a chain's first block wants the chain); a
    ghost counts once, and a later miss on the snapshot's own ghost counts it again."""
    p = policy(tune=tune)
    assert p.evicted_reuse == 0.0
    parent, other = block(10), block(20)
    beneath = snap(11, 3000, container=parent.key)
    for e in (beneath, parent, other):
        p.on_evict(e, 0.0, 0.0)
    assert p.evicted_reuse == 0.0
    p.on_miss(Kind.BLOCK, parent.key[1:], 0.0)
    f = 0.5 ** (1 / 1024)
    evicted = (beneath.size * f + parent.size) * f + other.size
    assert p.evicted_reuse == pytest.approx((beneath.size + parent.size) / evicted)
    p.on_miss(Kind.BLOCK, parent.key[1:], 0.0)  # its ghost is gone: a second miss adds nothing
    p.on_miss(Kind.STATE, beneath.key[1:], 0.0)  # the snapshot's ghost counts itself alone
    assert p.evicted_reuse == pytest.approx((2 * beneath.size + parent.size) / evicted)
    assert p.evicted_reuse > 1 and p.use_pays(block(30)) == 1.0  # a block pays in full whatever y


def test_y_halves_its_evidence_every_half_life_evictions() -> None:
    """half_life = 2: the snapshot asked for again weighs half as much after two more evictions."""
    p = policy(half_life=2)
    s = snap(1, 3000)
    p.on_evict(s, 0.0, 0.0)
    p.on_miss(Kind.STATE, s.key[1:], 0.0)
    assert p.evicted_reuse == 1.0
    b1, b2 = block(2), block(3)
    p.on_evict(b1, 0.0, 0.0)
    p.on_evict(b2, 0.0, 0.0)
    f = 0.5 ** 0.5
    assert p.evicted_reuse == pytest.approx(s.size / 2 / (s.size / 2 + b1.size * f + b2.size))


def test_the_bytes_carried_up_are_kept_for_the_num_ghosts_parents_touched_last() -> None:
    """num_ghosts = 2: three parents each have a snapshot evicted beneath them, so y's carry
    forgets the bytes beneath the parent touched longest ago. The two others, evicted and missed,
    count their snapshot's bytes with their own; the first its own alone."""
    p = policy(tune=False, num_ghosts=2)
    parents = [block(10), block(20), block(30)]
    for i, b in enumerate(parents):
        p.on_evict(snap(11 + i, 3000, container=b.key), 0.0, 0.0)
    f = 0.5 ** (1 / p.half_life)
    evicted, asked = (S * f + S) * f + S, 0.0  # the three snapshots, decayed by each later eviction
    for b, beneath in zip(reversed(parents), (S, S, 0)):
        p.on_evict(b, 0.0, 0.0)
        evicted, asked = evicted * f + b.size, asked * f
        p.on_miss(Kind.BLOCK, b.key[1:], 0.0)
        asked += b.size + beneath
        assert p.evicted_reuse == pytest.approx(asked / evicted)


def test_a_use_pays_the_kv_bytes_of_the_tokens_it_saves_over_the_bytes_it_displaces() -> None:
    """min(1, b x kv / (S x y)): with y = 1/2 a 100-token snapshot pays 200 x kv / S of its price
    a use; one past the crossover x y pays all of it. KV, a model without a shape and a store that
    never had anything asked for again (space costs nothing) pay in full."""
    p = priced(y_half=True)
    y = p.evicted_reuse
    assert p.use_pays(snap(1, 100)) == pytest.approx(100 * KV / (S * y))
    assert p.use_pays(snap(2, int(S / KV * y) + 1)) == 1.0
    assert p.use_pays(block(3)) == 1.0
    assert policy().use_pays(snap(4, 100)) == 1.0  # y = 0
    blind = FlopAware(PolicyContext(), tune=False)
    gone = block(5)
    blind.on_evict(gone, 0.0, 0.0)
    blind.on_miss(Kind.BLOCK, gone.key[1:], 0.0)
    assert blind.evicted_reuse == 1.0 and blind.use_pays(snap(6, 100)) == 1.0


def test_a_used_short_snapshot_is_not_kept_over_a_used_long_one_however_often_it_is_used() -> None:
    """The rule's invariant, under recency alone (w = 0), both snapshots of one origin: before
    their first use they rank alike (the first stay is the origin's bet: a chat turn's
    generation end is used once, by the next turn); once used, however often, the 16-token one
    is renewed by 16 x kv / S of a stay, the 3,000-token one by 3,000 x kv / S (y = 1), so it
    leaves first: it saves 16 tokens a use for 49.5 MiB."""
    p = priced(weight=0.0, tune=False)
    short, long_ = snap(1, 16), snap(2, 3000)
    for s in (short, long_):
        p.on_store(s, 0.0)
    assert p.priority(short, 0.0) == p.priority(long_, 0.0)
    for _ in range(100):
        p.on_hit(short, 0.0)
        short.num_hits += 1  # the store counts a hit after telling the policy
    p.on_hit(long_, 0.0)
    long_.num_hits += 1
    v = p.origins.value(Origin.JUNCTION)
    assert p.priority(short, 0.0) == pytest.approx(p.inflation + v * 16 * KV / S)
    assert p.priority(long_, 0.0) == pytest.approx(p.inflation + v * 3000 * KV / S)
    assert p.priority(short, 0.0) < p.priority(long_, 0.0)


def test_a_first_use_counts_as_the_share_of_a_reuse_that_it_pays() -> None:
    """Origin values weigh reuse by what it saves: the first use of a 1,000-token junction
    snapshot counts 1,000 x kv / S of a reuse (y = 1), a 5,000-token generation end's a whole one;
    repeat uses, none."""
    p = priced(tune=False)
    j, g = snap(1, 1000, Origin.JUNCTION), snap(2, 5000, Origin.GENERATION_END)
    for s in (j, g):
        p.on_store(s, 0.0)
        for hits in range(3):
            s.num_hits = hits
            p.on_hit(s, 0.0)
    assert p.origins.reused == {Origin.JUNCTION: pytest.approx(1000 * KV / S), Origin.GENERATION_END: 1.0}
