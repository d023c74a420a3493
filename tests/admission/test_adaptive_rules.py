"""Adaptive admission's rules at their boundaries: when it switches mode, when an origin or
a re-offer is dead, what its defaults are. Written against the survivors of a mutation
run (docs/testing.md): each test pins a decision a changed constant or operator flips."""

from __future__ import annotations

from prefixstore.admission import Adaptive, AlwaysAdmit, SecondHit
from prefixstore.protocol import Kind
from prefixstore.protocol.keys import Origin


def key(i: int) -> bytes:
    return bytes([3]) + i.to_bytes(16, "big")


def test_default_filters_take_one_mebibyte_and_a_tiny_budget_still_works() -> None:
    assert SecondHit().seen.memory_bytes == 1 << 20
    assert Adaptive().seen.memory_bytes == 1 << 20
    small = Adaptive(filter_bytes=16)  # the re-offer filter gets a quarter, but never under 16 bytes
    assert small.readmitted.memory_bytes == 16
    assert small.admit(Kind.STATE, key(1), 10, 0.0, Origin.PROMPT_END)


def test_nothing_seen_is_no_forfeit_and_always_ignores_origin() -> None:
    a = Adaptive()
    assert a.forfeit_fraction == 0.0 and a.always_mode
    always = AlwaysAdmit()
    assert always.admit(Kind.STATE, key(1), 10, 0.0) and always.admit(Kind.STATE, key(1), 10, 0.0, Origin.PERIODIC)


def _always_phase(a: Adaptive, first_hits: int, repeat_hits: int, evictions: int, wasted: int) -> None:
    """Feed the always-mode counters: evictions (some unreused), first hits (forfeits), then
    repeat hits, stopping at a switch (the counters restart there)."""
    for i in range(evictions):
        a.on_evict(Kind.STATE, 0 if i < wasted else 1, 0.0, Origin.UNKNOWN)
    for i in range(first_hits):
        a.on_hit(Kind.STATE, key(i), True, 0.0, Origin.UNKNOWN)
    for i in range(repeat_hits):
        a.on_hit(Kind.STATE, key(i), False, 0.0, Origin.UNKNOWN)
        if not a.always_mode:
            return


def test_enters_second_hit_only_when_reuse_is_heavy_tailed_and_evictions_are_mostly_waste() -> None:
    heavy = Adaptive(min_events=16)
    _always_phase(heavy, first_hits=2, repeat_hits=30, evictions=20, wasted=20)  # F/(F+R) = 0.06, waste 1.0
    assert not heavy.always_mode
    not_heavy = Adaptive(min_events=16)
    _always_phase(not_heavy, first_hits=30, repeat_hits=2, evictions=20, wasted=20)  # F/(F+R) = 0.94
    assert not_heavy.always_mode
    little_waste = Adaptive(min_events=16)
    _always_phase(little_waste, first_hits=2, repeat_hits=30, evictions=20, wasted=5)  # waste 0.25 < 0.5
    assert little_waste.always_mode
    half_waste = Adaptive(min_events=16)
    _always_phase(half_waste, first_hits=2, repeat_hits=30, evictions=20, wasted=10)  # waste exactly 0.5
    assert not half_waste.always_mode
    few_evictions = Adaptive(min_events=16)
    _always_phase(few_evictions, first_hits=2, repeat_hits=30, evictions=15, wasted=15)  # 15 < min_events
    assert few_evictions.always_mode


def test_counters_restart_at_a_switch() -> None:
    a = Adaptive(min_events=16)
    _always_phase(a, first_hits=2, repeat_hits=30, evictions=20, wasted=20)
    assert not a.always_mode
    assert (a.forfeited, a.repeat_hits, a.evictions, a.wasted) == (0.0, 0.0, 0.0, 0.0)


def test_second_hit_mode_returns_to_always_when_forfeits_pass_the_threshold() -> None:
    a = Adaptive(min_events=16)
    _always_phase(a, first_hits=2, repeat_hits=30, evictions=20, wasted=20)
    assert not a.always_mode
    for i in range(64):  # evictions go on (else it returns at once), and repeat hits: keep judging
        a.on_evict(Kind.STATE, 0, 0.0)
        a.on_hit(Kind.STATE, key(i), False, 0.0)
    assert not a.always_mode
    assert a.repeat_hits < 64  # halved while it keeps judging
    for i in range(200):  # re-offers of turned-away keys: each is a forfeited hit
        k = key(10_000 + i)
        a.admit(Kind.STATE, k, 10, 0.0)
        a.admit(Kind.STATE, k, 10, 0.0)
        if a.always_mode:
            break
    assert a.always_mode


def _judge(a: Adaptive, origin: int, evicted: int, reused: int) -> None:
    for i in range(evicted):
        a.on_evict(Kind.STATE, 1 if i < reused else 0, 0.0, origin)


def test_an_origin_is_dead_below_one_twentieth_of_the_best_and_not_at_it() -> None:
    at = Adaptive()
    _judge(at, Origin.JUNCTION, evicted=20, reused=20)  # best: 1.0
    _judge(at, Origin.GENERATION_END, evicted=20, reused=1)  # 0.05: exactly 1/20 of the best
    assert not at.origin_is_dead(Origin.GENERATION_END)
    below = Adaptive()
    _judge(below, Origin.JUNCTION, evicted=20, reused=20)
    _judge(below, Origin.GENERATION_END, evicted=40, reused=1)  # 0.025
    assert below.origin_is_dead(Origin.GENERATION_END) and not below.origin_is_dead(Origin.JUNCTION)
    assert not below.origin_is_dead(Origin.UNKNOWN)  # an engine that does not say why is never judged


def test_an_origin_is_judged_on_sixteen_outcomes_counting_live_reused_ones() -> None:
    a = Adaptive()
    for i in range(16):  # the best origin's snapshots were reused and are still held
        a.on_hit(Kind.STATE, key(i), True, 0.0, Origin.JUNCTION)
    _judge(a, Origin.GENERATION_END, evicted=15, reused=0)
    assert not a.origin_is_dead(Origin.GENERATION_END)  # 15 outcomes: too few
    _judge(a, Origin.GENERATION_END, evicted=1, reused=0)
    assert a.origin_is_dead(Origin.GENERATION_END)
    # A reused snapshot that is evicted is counted once: as reused, not also as live.
    b = Adaptive()
    for i in range(16):
        b.on_hit(Kind.STATE, key(i), True, 0.0, Origin.JUNCTION)
        b.on_evict(Kind.STATE, 1, 0.0, Origin.JUNCTION)
    _judge(b, Origin.GENERATION_END, evicted=20, reused=1)  # 0.05 of the best (1.0): not dead
    assert not b.origin_is_dead(Origin.GENERATION_END)
    # An unreused eviction does not take a live one away.
    c = Adaptive()
    for i in range(16):
        c.on_hit(Kind.STATE, key(i), True, 0.0, Origin.JUNCTION)
    _judge(c, Origin.JUNCTION, evicted=16, reused=0)  # 16 live reused + 16 evicted unreused: 0.5
    _judge(c, Origin.GENERATION_END, evicted=40, reused=1)  # 0.025 = 1/20 of 0.5: not dead
    assert not c.origin_is_dead(Origin.GENERATION_END)


def test_origin_counts_decay_by_half_past_256() -> None:
    a = Adaptive()
    _judge(a, Origin.JUNCTION, evicted=16, reused=16)
    _judge(a, Origin.GENERATION_END, evicted=257, reused=0)  # halved at the 257th: 128.5 evicted
    assert a.origin_is_dead(Origin.GENERATION_END)
    _judge(a, Origin.GENERATION_END, evicted=8, reused=8)
    # Recovery: 8 reused of 136.5 = 0.059 >= 0.05 x the best (1.0). Without the halving,
    # 8 of 265 = 0.030 and it would still be dead: old evidence fades, so it comes back.
    assert not a.origin_is_dead(Origin.GENERATION_END)


def test_a_re_offer_is_dead_only_below_one_twentieth_of_first_offers_rate() -> None:
    a = Adaptive()
    for i in range(40):  # first offers, half reused: 0.5
        k = key(i)
        a.admit(Kind.STATE, k, 10, 0.0)
        if i % 2:
            a.on_hit(Kind.STATE, k, True, 0.0)
    for i in range(40):  # each offered again, one in forty reused: 0.025 = 1/20 of 0.5
        k = key(i)
        if i == 0:
            a.admit(Kind.STATE, k, 10, 0.0)
            a.on_hit(Kind.STATE, k, True, 0.0)
        elif not a.admit(Kind.STATE, k, 10, 0.0):
            break
    assert a.offers[True] == 40 and not a.reoffers_are_dead()
    b = Adaptive()
    for i in range(16):
        b.admit(Kind.STATE, key(i), 10, 0.0)
        b.on_hit(Kind.STATE, key(i), True, 0.0)
    for i in range(15):
        b.admit(Kind.STATE, key(i), 10, 0.0)
    assert not b.reoffers_are_dead()  # 15 re-admissions: too few
    b.admit(Kind.STATE, key(15), 10, 0.0)
    assert b.reoffers_are_dead()
    c = Adaptive()  # plenty of re-offers but too few first offers to compare with
    for i in range(15):
        c.admit(Kind.STATE, key(i), 10, 0.0)
    for _ in range(3):
        for i in range(15):
            c.admit(Kind.STATE, key(i), 10, 0.0)
    assert c.offers[True] == 45 and not c.reoffers_are_dead()


def test_offer_counts_decay_by_half_past_256() -> None:
    a = Adaptive()
    for i in range(257):
        a.admit(Kind.STATE, key(i), 10, 0.0)
        a.on_hit(Kind.STATE, key(i), True, 0.0)
    assert a.offers[False] == 128.5 and a.offers_reused[False] == 128.0 + 1  # halved at the 257th offer


def test_forfeits_are_measured_against_all_hits() -> None:
    """F / (F + R): 10 forfeits beside 22 repeat hits is 0.31, not heavy-tailed enough."""
    a = Adaptive(min_events=16)
    _always_phase(a, first_hits=10, repeat_hits=22, evictions=20, wasted=20)
    assert a.always_mode


def test_second_hit_mode_halves_its_evidence_and_returns_once_evictions_stop() -> None:
    a = Adaptive(min_events=16)
    _always_phase(a, first_hits=2, repeat_hits=30, evictions=20, wasted=20)
    assert not a.always_mode
    a.on_evict(Kind.STATE, 0, 0.0)
    for i in range(4):  # 4 forfeits (re-offers of turned-away keys) ...
        a.admit(Kind.STATE, key(5_000 + i), 10, 0.0)
        a.admit(Kind.STATE, key(5_000 + i), 10, 0.0)
    for i in range(12):  # ... and 12 repeat hits: 0.25 <= 0.35, keep judging, on halved evidence
        a.on_hit(Kind.STATE, key(i), False, 0.0)
    assert not a.always_mode
    assert (a.forfeited, a.repeat_hits, a.evictions) == (2.0, 6.0, 0.5)
    for i in range(8):  # no more evictions: the cache has room again, so back to always
        a.on_hit(Kind.STATE, key(i), False, 0.0)
    assert a.always_mode


def test_only_a_reused_eviction_moves_a_live_reused_one() -> None:
    a = Adaptive()
    for i in range(16):
        a.on_hit(Kind.STATE, key(i), True, 0.0, Origin.JUNCTION)  # reused, still held
    _judge(a, Origin.JUNCTION, evicted=16, reused=0)  # 16 others leave unreused: 16 of 32 = 0.5
    _judge(a, Origin.PROMPT_END, evicted=20, reused=10)  # 0.5
    assert not a.origin_is_dead(Origin.JUNCTION)


def test_exactly_min_events_evictions_are_enough_to_switch() -> None:
    a = Adaptive(min_events=16)
    _always_phase(a, first_hits=2, repeat_hits=30, evictions=16, wasted=16)
    assert not a.always_mode


def test_re_offers_reused_under_a_twentieth_of_first_offers_are_dead() -> None:
    a = Adaptive()
    for i in range(80):  # first offers, half reused: 0.5
        a.admit(Kind.STATE, key(i), 10, 0.0)
        if i % 2:
            a.on_hit(Kind.STATE, key(i), True, 0.0)
    a.admit(Kind.STATE, key(0), 10, 0.0)
    a.on_hit(Kind.STATE, key(0), True, 0.0)  # one re-offer reused ...
    for i in range(1, 80):  # ... of 80: 0.0125 < 0.025
        if not a.admit(Kind.STATE, key(i), 10, 0.0):
            break
    assert a.reoffers_are_dead()


def test_origin_decay_halves_the_reused_count_too() -> None:
    a = Adaptive()
    _judge(a, Origin.JUNCTION, evicted=16, reused=16)
    _judge(a, Origin.GENERATION_END, evicted=257, reused=20)  # halved: 10 of 128.5 = 0.078
    assert not a.origin_is_dead(Origin.GENERATION_END)


def test_documented_defaults() -> None:
    a = Adaptive()
    assert (a.min_events, a.enter_below, a.leave_above, a.min_waste, a.dead_origin_rate, a.dead_origin_samples) == \
        (64, 0.2, 0.35, 0.5, 0.05, 16.0)
    assert a.readmitted.memory_bytes == (1 << 20) // 4  # a quarter of the sighting filter's budget


def test_an_engine_that_gives_no_origin_is_never_judged_dead() -> None:
    a = Adaptive()
    _judge(a, Origin.JUNCTION, evicted=20, reused=20)
    _judge(a, Origin.UNKNOWN, evicted=40, reused=0)
    assert not a.origin_is_dead(Origin.UNKNOWN)
    assert a.admit(Kind.STATE, key(1), 10, 0.0, Origin.UNKNOWN)


def test_origin_decay_halves_both_counts_so_no_origin_looks_better_than_it_was() -> None:
    a = Adaptive()
    _judge(a, Origin.JUNCTION, evicted=16, reused=16)  # 1.0
    _judge(a, Origin.PROMPT_END, evicted=50, reused=3)  # 0.06: alive beside 1.0
    _judge(a, Origin.GENERATION_END, evicted=257, reused=100)  # halved: 50 of 128.5 = 0.39
    assert not a.origin_is_dead(Origin.PROMPT_END)  # GENERATION_END did not become a rate above 1


def _hit_at(a: Adaptive, forfeited: float, repeat_hits: float) -> Adaptive:
    """One repeat hit on counters of ``forfeited`` first hits and ``repeat_hits`` repeat hits (a
    judgement is made on every hit once min_events hits are counted)."""
    a.forfeited, a.repeat_hits = forfeited, repeat_hits
    a.on_hit(Kind.STATE, key(1), False, 0.0)
    return a


def test_the_default_enters_second_hit_below_a_fifth_of_hits_forfeited_and_not_at_it() -> None:
    """docs/design.md: second-hit only when hits second-hit would forfeit are < 20% of hits."""
    def heavy() -> Adaptive:
        a = Adaptive()
        a.evictions = a.wasted = 64.0  # every eviction a never-reused snapshot
        return a

    assert not _hit_at(heavy(), 19.0, 80.0).always_mode  # 19 of 100
    assert _hit_at(heavy(), 20.0, 79.0).always_mode  # 20 of 100


def test_the_default_returns_to_always_above_35_percent_forfeited_and_not_at_it() -> None:
    """docs/design.md: it returns as soon as forfeits exceed 35%."""
    def second_hit() -> Adaptive:
        a = Adaptive()
        a.always_mode = False
        a.evictions = 8.0  # still evicting
        return a

    assert not _hit_at(second_hit(), 35.0, 64.0).always_mode  # 35 of 100
    assert _hit_at(second_hit(), 36.0, 63.0).always_mode  # 36 of 100
