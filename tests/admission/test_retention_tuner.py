"""The periodic interval the default chooses (IntervalTuner), re-offer judging in adaptive
admission, and the origin value's shrinkage: each test names the traffic and the decision
it must lead to."""

from __future__ import annotations

import json
import math

import pytest

from prefixstore.admission import INTERVAL_GRANULE, Adaptive, IntervalTuner, get_model, optimal_interval
from prefixstore.admission.eviction import OriginValue
from prefixstore.protocol import Kind
from prefixstore.protocol.keys import Origin

MODEL = get_model("mamba2-hybrid-7b")  # S = 51,904,512 bytes, 16,384 bytes of KV per token
S, KV = MODEL.state_bytes, MODEL.kv_bytes_per_token


def tuner(**kw: float) -> IntervalTuner:
    return IntervalTuner(S, KV, **kw)  # type: ignore[arg-type]


def rounded(x: float) -> int:
    return max(INTERVAL_GRANULE, round(x / INTERVAL_GRANULE) * INTERVAL_GRANULE)


def test_before_any_evidence_the_interval_is_the_crossover() -> None:
    t = tuner(half_life=1e12)
    assert t.choice().interval == -1 and "prior" in t.choice().reason
    assert t.interval_for(40_000) == rounded(S / KV) == 3072  # crossover 3,168 tokens, on the 256 granule
    for _ in range(15):
        t.observe(kv_tokens=0, state_tokens=0, consumed_tokens=1000)
    assert t.interval == -1  # 15 < min_requests
    t.observe(kv_tokens=0, state_tokens=0, consumed_tokens=1000)
    assert t.interval == 0  # evidence now: nothing resumed mid-context


def test_conversation_traffic_gets_no_periodic_snapshots() -> None:
    """Each turn resumes exactly at the previous turn's end, where its snapshot is."""
    t = tuner()
    history = 1500
    for _ in range(200):
        t.observe(kv_tokens=history, state_tokens=history, consumed_tokens=history + 450)
        history += 450
    c = t.choice()
    assert c.interval == 0 and t.interval_for(100_000) == 0
    assert "no mid-context resumes" in c.reason and c.resume_share == 0.0


def test_mid_context_resumes_give_the_cost_models_interval() -> None:
    """Half the requests resume 8,000 tokens past their snapshot; each computes 2,000 new
    tokens: T = 2,000 / 0.5 = 4,000 new tokens per resume, and I* = sqrt(2 T S / KV)."""
    t = tuner(half_life=1e12)  # no decay: exact sums
    for i in range(400):
        if i % 2:
            t.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=22_000)
        else:
            t.observe(kv_tokens=0, state_tokens=0, consumed_tokens=2_000)
    c = t.choice()
    assert c.resume_share == pytest.approx(0.5)
    assert c.tokens_per_resume == pytest.approx(4_000)
    ideal = optimal_interval(4_000, S, 1 / KV, 1.0)
    assert c.ideal_tokens == pytest.approx(ideal) and ideal == pytest.approx(math.sqrt(2 * 4_000 * S / KV))
    assert c.interval == rounded(ideal) == t.interval_for(10) == 5120
    assert c.interval % INTERVAL_GRANULE == 0
    # More resumes per new token: denser checkpoints; fewer: sparser.
    dense, sparse = tuner(half_life=1e12), tuner(half_life=1e12)
    for _ in range(400):
        dense.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=21_000)
        sparse.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=60_000)
    assert dense.interval < c.interval < sparse.interval


def test_a_resume_served_by_a_periodic_snapshot_still_counts() -> None:
    """Once checkpoints work the gap they serve is under one granule; counting only the gaps
    left would switch them off (and the gaps would come back)."""
    t = tuner(half_life=1e12)
    for _ in range(40):
        t.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=21_000)
    on = t.interval
    assert on > 0
    for _ in range(400):  # now each resume finds a periodic snapshot just below its KV match
        t.observe(kv_tokens=on * 3 + 100, state_tokens=on * 3, consumed_tokens=on * 3 + 1_100)
    assert t.interval > 0 and t.choice().resume_share == pytest.approx(1.0)
    # A snapshot off the granule with a small gap is a structural one: not a resume.
    s = tuner(half_life=1e12)
    for _ in range(40):
        s.observe(kv_tokens=1_000, state_tokens=999, consumed_tokens=1_200)
    assert s.interval == 0


def test_the_choice_follows_the_traffic_as_it_changes() -> None:
    t = tuner(half_life=64)
    for _ in range(200):
        t.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=21_000)
    assert t.interval > 0
    for _ in range(2_000):  # then only conversations
        t.observe(kv_tokens=3_000, state_tokens=3_000, consumed_tokens=3_400)
    assert t.interval == 0


def test_the_choice_is_explained_and_json_safe() -> None:
    t = tuner()
    for _ in range(20):
        t.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=21_000)
    c = t.choice()
    text = c.describe()
    assert f"{c.interval:,}" in text and "sqrt(2*T*S*alpha/beta)" in text and f"{S:,}" in text
    idle = tuner()
    json.dumps(idle.choice().to_dict(), allow_nan=False)  # no infinity in JSON
    assert idle.choice().to_dict()["ideal_tokens"] is None
    assert "prior" in idle.choice().describe()
    for _ in range(20):
        idle.observe(kv_tokens=0, state_tokens=0, consumed_tokens=100)
    assert idle.choice().describe().startswith("no periodic snapshots")
    with pytest.raises(ValueError, match="state_bytes"):
        IntervalTuner(0, KV)


def test_adaptive_refuses_re_offers_that_are_never_reused() -> None:
    """Every prompt sent exactly twice: a snapshot offered again (after its first copy was
    evicted) is the last send's, and is never reused."""
    a = Adaptive(filter_bytes=1 << 16)
    now = 0.0
    for i in range(40):
        key = bytes([3]) + i.to_bytes(16, "big")
        assert a.admit(Kind.STATE, key, 100, now, Origin.PROMPT_END)
        if i % 2:
            a.on_hit(Kind.STATE, key, True, now, Origin.PROMPT_END)  # first offers: reused
        a.on_evict(Kind.STATE, i % 2, now, Origin.PROMPT_END)
        if i < 16:
            assert a.admit(Kind.STATE, key, 100, now, Origin.PROMPT_END)  # offered again
            a.on_evict(Kind.STATE, 0, now, Origin.PROMPT_END)
    assert a.offers[True] == 16 and a.offers_reused[True] == 0
    assert a.offers[False] == 40 and a.offers_reused[False] == 20
    assert a.reoffers_are_dead()
    again = bytes([3]) + (7).to_bytes(16, "big")
    assert not a.admit(Kind.STATE, again, 100, now, Origin.PROMPT_END)  # a re-offer: refused
    fresh = bytes([3]) + (999).to_bytes(16, "big")
    assert a.admit(Kind.STATE, fresh, 100, now, Origin.PROMPT_END)  # a first offer: taken


def test_adaptive_keeps_re_offers_that_are_reused() -> None:
    """Under heavy-tailed reuse a returning prefix is a popular one."""
    a = Adaptive(filter_bytes=1 << 16)
    for i in range(40):
        key = bytes([3]) + i.to_bytes(16, "big")
        a.admit(Kind.STATE, key, 100, 0.0, Origin.JUNCTION)
        a.on_evict(Kind.STATE, 0, 0.0, Origin.JUNCTION)
        assert a.admit(Kind.STATE, key, 100, 0.0, Origin.JUNCTION)
        a.on_hit(Kind.STATE, key, True, 0.0, Origin.JUNCTION)  # the returning one is reused
    assert not a.reoffers_are_dead()
    assert a.offers_reused[True] == 40 and a.offers_reused[False] == 0


def test_re_offers_are_judged_only_on_enough_evidence() -> None:
    a = Adaptive(filter_bytes=1 << 16, dead_origin_samples=16)
    for i in range(15):
        key = bytes([3]) + i.to_bytes(16, "big")
        a.admit(Kind.STATE, key, 100, 0.0, Origin.PROMPT_END)
        a.on_hit(Kind.STATE, key, True, 0.0, Origin.PROMPT_END)
        a.admit(Kind.STATE, key, 100, 0.0, Origin.PROMPT_END)
    assert a.offers[True] == 15 and not a.reoffers_are_dead()  # 15 < 16 re-admissions


def test_an_origin_seen_twice_is_judged_by_the_overall_rate_not_a_fixed_prior() -> None:
    """Reuse-twice at 5%: prompt ends earn every hit (7 of 193 reused); a junction origin
    seen twice and never reused must not become the 'best' origin."""
    v = OriginValue()
    for i in range(193):
        v.on_store(Origin.PROMPT_END)
        if i < 7:
            v.on_first_hit(Origin.PROMPT_END)
    for _ in range(48):
        v.on_store(Origin.GENERATION_END)
    for _ in range(2):
        v.on_store(Origin.JUNCTION)
    assert v.value(Origin.PROMPT_END) == 1.0
    assert v.value(Origin.JUNCTION) < 1.0
    assert v.value(Origin.GENERATION_END) < v.value(Origin.JUNCTION)
    overall = 7.5 / 244
    assert v.rate(Origin.JUNCTION) == pytest.approx(4 * overall / 6)


def test_planner_boundaries_at_their_edges() -> None:
    """Periodic boundaries start past the reused prefix (never at it), reach the prompt end
    inclusive, and during decode start past the prompt; a hint counts only inside
    (reused, prompt]; a prompt end only when something was computed."""
    from prefixstore.admission import RetentionPlanner

    p = RetentionPlanner(interval=100)
    assert p.prefill_boundaries(300, 100) == {200: Origin.PERIODIC, 300: Origin.PROMPT_END}
    assert p.prefill_boundaries(300, 99) == {100: Origin.PERIODIC, 200: Origin.PERIODIC, 300: Origin.PROMPT_END}
    assert p.prefill_boundaries(300, 300) == {}  # all reused: nothing new to snapshot
    assert p.prefill_boundaries(300, 100, hint=100) == {200: Origin.PERIODIC, 300: Origin.PROMPT_END}
    assert p.prefill_boundaries(300, 100, hint=301) == {200: Origin.PERIODIC, 300: Origin.PROMPT_END}
    assert p.prefill_boundaries(300, 100, hint=150)[150] == Origin.JUNCTION
    assert RetentionPlanner(interval=100, junction_hints=False).prefill_boundaries(300, 100, hint=150) == \
        {200: Origin.PERIODIC, 300: Origin.PROMPT_END}
    assert p.decode_boundaries(300, 101) == {400: Origin.GENERATION_END}  # consumed 400: the end wins
    assert p.decode_boundaries(300, 102) == {400: Origin.PERIODIC, 401: Origin.GENERATION_END}
    assert p.decode_boundaries(300, 1) == {}
    assert RetentionPlanner(interval=100, generation_end=False).decode_boundaries(300, 102) == {400: Origin.PERIODIC}
    assert RetentionPlanner().decode_boundaries(300, 102) == {401: Origin.GENERATION_END}
    plan = p.plan(300, 102, reused_tokens=100, hint=300)
    assert list(plan) == sorted(plan) and plan[300] == Origin.PROMPT_END  # a prompt end wins over a hint


def test_inputs_are_validated_at_their_bounds() -> None:
    from prefixstore.admission import crossover_tokens

    with pytest.raises(ValueError):
        crossover_tokens(S, 0)
    with pytest.raises(ValueError):
        optimal_interval(0, S, 1.0, 1.0)
    with pytest.raises(ValueError, match="kv_bytes_per_token"):
        IntervalTuner(S, 0)
    assert IntervalTuner(1, 1).interval_for(10) == INTERVAL_GRANULE  # the smallest valid shapes


def test_planner_defaults_and_a_periodic_boundary_at_the_prompt_end() -> None:
    from prefixstore.admission import RetentionPlanner

    assert RetentionPlanner(interval=1).plan(3, 1) == {1: Origin.PERIODIC, 2: Origin.PERIODIC, 3: Origin.PROMPT_END}
    assert RetentionPlanner(interval=100, prompt_end=False).prefill_boundaries(300, 100) == \
        {200: Origin.PERIODIC, 300: Origin.PERIODIC}


def test_sums_decay_exactly_and_half_a_resume_is_still_evidence() -> None:
    t = tuner(half_life=1, min_requests=1)  # every sum halves before each request
    t.observe(kv_tokens=20_000, state_tokens=12_000, consumed_tokens=21_000)  # a resume, 1,000 new tokens
    t.observe(kv_tokens=0, state_tokens=0, consumed_tokens=3_001)  # not a resume, 3,001 new tokens
    c = t.choice()
    assert (t.requests, t.resumes, t.new_tokens) == (1.5, 0.5, 3_501.0)
    assert c.tokens_per_resume == 7_002.0 and c.interval > 0
    assert c.resume_share == pytest.approx(1 / 3)
    assert "alpha/beta = 1/16,384 tokens per byte" in c.describe()
    assert tuner().choice().describe().startswith("periodic per context from the prior")


def test_a_sighting_generation_holds_an_eighth_of_its_bits_over_three_probes() -> None:
    from prefixstore.admission import SightingFilter

    f = SightingFilter(1024)  # 512 bytes a generation: 4,096 bits
    assert f.num_bits == 4096 and f.generation_capacity == 4096 // 24 == 170
    for i in range(169):
        f.add(i.to_bytes(8, "big"))
    keys = [i.to_bytes(8, "big") for i in range(1000, 1000 + 170 * 2)]
    for k in keys:
        f.add(k)
    assert keys[-1] in f and keys[200] in f  # the two newest generations are remembered
    assert sum(i.to_bytes(8, "big") in f for i in range(169)) < 5  # the oldest were forgotten


def test_a_generation_turns_over_exactly_at_its_capacity() -> None:
    from prefixstore.admission import SightingFilter

    with pytest.raises(ValueError, match="num_bytes"):
        SightingFilter(15)
    f = SightingFilter(16)  # 64 bits: a generation holds 64 // 24 = 2 keys
    assert f.generation_capacity == 2
    k = [bytes([i]) * 8 for i in range(1, 6)]
    f.add(k[0])
    f.add(k[1])  # full: it becomes the previous generation
    f.add(k[2])
    f.add(k[3])  # full again: k0, k1 are forgotten, k2, k3 remembered
    assert k[2] in f and k[3] in f and k[0] not in f and k[1] not in f
