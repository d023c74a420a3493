"""FLOP-aware eviction's arithmetic pinned to exact values: the priority formula, the running
mean behind E, the weight's bounds, origin values' decay, what an entry hangs from.
Written against the survivors of a mutation run (docs/testing.md)."""

from __future__ import annotations

import pytest

from prefixstore.admission import FlopAware, PolicyContext, get_model
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
