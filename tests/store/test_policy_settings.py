"""Every admission and eviction setting changes what the real store does.

A store that ignored ``kv_admission``, ``state_admission`` or ``eviction`` (running
its default whatever the config says) fails here: each test scripts a sequence
whose outcome differs between the settings, through the Store's public methods
(offer / plan_put / commit / lookup) and its ``stats()``.

Namespace (tests/factories.py): B = 4 tokens, 64 bytes of KV per token (a block is
256 bytes, 4 pages of 64 B), a 16-byte snapshot (1 page).
"""

from __future__ import annotations

import pytest

from prefixstore.client.prompt import Prompt, with_payload
from prefixstore.protocol import Namespace
from prefixstore.protocol.keys import Origin
from prefixstore.store import StoreConfig

from ..factories import kv_payload, make_namespace, state_payload
from .harness import CoreHarness, fill_target

ADMISSION = ("always", "second-hit", "adaptive")


@pytest.fixture
def ns() -> Namespace:
    return make_namespace(block_tokens=4)


@pytest.fixture
def harness():  # type: ignore[no-untyped-def]
    made: list[CoreHarness] = []

    def make(ns: Namespace, **knobs: object) -> CoreHarness:
        kw: dict[str, object] = {"eviction": "lru", "kv_admission": "always", "state_admission": "always", **knobs}
        config = StoreConfig(port=0, data_dir="none", ram_bytes=int(kw.pop("ram_bytes", 1 << 20)),  # type: ignore[call-overload]
                             page_bytes=64, **kw)  # type: ignore[arg-type]
        made.append(CoreHarness(config, ns))
        return made[-1]

    yield make
    for h in made:
        h.close()


def statuses(h: CoreHarness, tokens: list[int], kv_upto: int, snapshots: dict[int, int] | None = None) -> list[str]:
    """Offer KV [0, kv_upto) and snapshots {boundary: origin}; the store's answers, in order."""
    p = Prompt(h.ns, tokens)
    specs = [s for s, _, _ in p.kv_items(kv_upto)] + [p.state_item(t, kv_upto, o) for t, o in (snapshots or {}).items()]
    return [d.status for d in h.store.offer(h.ns.id, specs)]


@pytest.mark.parametrize("policy", ADMISSION)
def test_kv_admission_setting_decides_a_first_and_a_second_offer(ns, harness, policy: str) -> None:  # type: ignore[no-untyped-def]
    h = harness(ns, kv_admission=policy)
    first = statuses(h, [1, 2, 3, 4], 4)
    second = statuses(h, [1, 2, 3, 4], 4)
    # always and adaptive (which starts as always) take a first offer; second-hit only remembers it.
    assert first == (["rejected"] if policy == "second-hit" else ["want"])
    assert second == ["want"]
    assert h.store.stats()["policies"]["kv_admission"] == policy  # type: ignore[index]


@pytest.mark.parametrize("policy", ADMISSION)
def test_state_admission_setting_decides_a_first_and_a_second_offer(ns, harness, policy: str) -> None:  # type: ignore[no-untyped-def]
    h = harness(ns, state_admission=policy)
    h.save([1, 2, 3, 4], 4)  # the KV the snapshot needs (KV admission: always)
    first = statuses(h, [1, 2, 3, 4], 4, {4: Origin.PROMPT_END})
    second = statuses(h, [1, 2, 3, 4], 4, {4: Origin.PROMPT_END})
    assert first == ["have", "rejected" if policy == "second-hit" else "want"]
    assert second == ["have", "want"]
    assert h.store.stats()["policies"]["state_admission"] == policy  # type: ignore[index]


def save_with_origins(h: CoreHarness, tokens: list[int], kv_upto: int, snapshots: dict[int, int]) -> None:
    """CoreHarness.save, with each snapshot's origin ({boundary: origin})."""
    p = Prompt(h.ns, tokens)
    specs = [s for s, _, _ in p.kv_items(kv_upto)] + [p.state_item(t, kv_upto, o) for t, o in snapshots.items()]
    payloads = [kv_payload(h.ns, tokens, a, b) for _, a, b in p.kv_items(kv_upto)] + \
        [state_payload(h.ns, tokens, t) for t in snapshots]
    decided = h.store.offer(h.ns.id, specs)
    wanted = [(with_payload(s, pl), pl) for s, pl, d in zip(specs, payloads, decided) if d.status == "want"]
    plan = h.store.plan_put(h.ns.id, [s for s, _ in wanted])
    for target, (_, pl) in zip(plan.targets, wanted):
        fill_target(target, pl)
    h.store.verify_put(plan)
    h.run(h.store.commit(h.ns.id, plan.keys))


def _learn_dead_generation_ends(h: CoreHarness, rounds: int = 48) -> None:
    """Sequences of one block with a prompt-end snapshot (at 2) that the next lookup
    reuses, and a generation-end snapshot (at 4) that nothing reuses; a small RAM
    makes older ones leave. Adaptive learns the generation-end origin is dead."""
    for i in range(rounds):
        h.now[0] += 1.0
        seq = [10_000 + 4 * i + k for k in range(4)]
        save_with_origins(h, seq, 4, {2: Origin.PROMPT_END, 4: Origin.GENERATION_END})
        _, a = h.lookup(seq[:2] + [1, 1, 1], lease=False)  # the prompt-end snapshot serves this one
        assert a.state_tokens == 2
        h.store.check()


@pytest.mark.parametrize("policy", ("always", "adaptive"))
def test_adaptive_state_admission_refuses_an_origin_it_learned_is_never_reused(ns, harness, policy: str) -> None:  # type: ignore[no-untyped-def]
    # 8 sequences' worth of RAM (6 pages each): the older ones are evicted as new ones come.
    h = harness(ns, state_admission=policy, ram_bytes=8 * 6 * 64)
    _learn_dead_generation_ends(h)
    h.now[0] += 1.0
    fresh = [77, 78, 79, 80]
    h.save(fresh, 4)
    got = statuses(h, fresh, 4, {2: Origin.PROMPT_END, 4: Origin.GENERATION_END})
    assert got[0] == "have"
    # always takes both; adaptive takes the prompt end (reused) and refuses the generation end.
    assert got[1:] == (["want", "want"] if policy == "always" else ["want", "rejected"])


def _fill_and_touch(h: CoreHarness, base: int, n: int) -> list[list[int]]:
    seqs = [[base + 4 * i + k for k in range(4)] for i in range(n)]
    for s in seqs:
        h.now[0] += 1.0
        h.save(s, 4)
    return seqs


@pytest.mark.parametrize("policy", ("always", "adaptive"))
def test_adaptive_kv_admission_refuses_re_offers_it_learned_are_never_reused(ns, harness, policy: str) -> None:  # type: ignore[no-untyped-def]
    """Every block is sent twice: once reused by a lookup, then (after it was evicted)
    offered again and never reused. Adaptive learns that re-offered blocks are dead
    and refuses the next one; always takes it."""
    h = harness(ns, kv_admission=policy, ram_bytes=8 * 4 * 64)  # 8 blocks of 4 tokens
    for r in range(6):
        seqs = _fill_and_touch(h, 100_000 * (r + 1), 8)
        for s in seqs:
            _, a = h.lookup(s + [5], lease=False)  # first offers: reused
            assert a.kv_tokens == 4
        _fill_and_touch(h, 900_000 + 100 * r, 8)  # evicts them
        for s in seqs:  # offered again after eviction, never looked up again
            h.now[0] += 1.0
            h.save(s, 4)
        _fill_and_touch(h, 950_000 + 100 * r, 8)
    h.store.check()
    again = statuses(h, [100_000, 100_001, 100_002, 100_003], 4)  # offered twice before, evicted again
    assert again == (["want"] if policy == "always" else ["rejected"])


@pytest.mark.parametrize("policy", ("lru", "flop-aware"))
def test_eviction_setting_decides_which_snapshot_leaves(ns, harness, policy: str) -> None:  # type: ignore[no-untyped-def]
    """A long prefix's snapshot stored first, a short one's stored later, then room is
    needed for one page: LRU drops the older (long) snapshot, FLOP-aware the one that
    saves less recompute per byte (the short one)."""
    long_seq = list(range(1, 41))  # 10 blocks, 40 pages, and a snapshot at 40 (1 page)
    short_seq = [500, 501, 502, 503]  # 1 block, 4 pages, and a snapshot at 4 (1 page)
    h = harness(ns, eviction=policy, ram_bytes=46 * 64)
    h.save(long_seq, 40, {40: state_payload(ns, long_seq, 40)})
    h.now[0] += 10.0
    h.save(short_seq, 4, {4: state_payload(ns, short_seq, 4)})
    h.now[0] += 10.0
    assert h.save([900], 1)["committed"] == 1  # one page: a tail of one token
    _, long_answer = h.lookup(long_seq + [7], lease=False)
    _, short_answer = h.lookup(short_seq + [7], lease=False)
    kept = {"long": long_answer.state_tokens, "short": short_answer.state_tokens}
    assert kept == ({"long": 0, "short": 4} if policy == "lru" else {"long": 40, "short": 0})
    assert (long_answer.kv_tokens, short_answer.kv_tokens) == (40, 4)  # only a snapshot left
    assert h.store.stats()["policies"]["eviction"] == policy  # type: ignore[index]
    h.store.check()


def test_an_unknown_policy_name_fails_at_start_naming_the_knob() -> None:
    for knob in ("kv_admission", "state_admission", "eviction"):
        with pytest.raises(Exception, match=knob):
            StoreConfig(port=0, data_dir="none", **{knob: "nope"})  # type: ignore[arg-type]



def test_adaptive_moves_to_second_hit_when_lookups_show_heavy_tailed_reuse(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """Five hot prefixes looked up again and again while one-off snapshots come and go
    unreused: the store must tell the policy which hits are repeats (an entry's hit count),
    and adaptive then stops admitting first offers."""
    h = harness(ns, state_admission="adaptive", ram_bytes=40 * 64)  # 8 one-block sequences with a snapshot
    hot = [[7_000 + 4 * i + k for k in range(4)] for i in range(5)]
    for s in hot:
        h.save(s, 4, {4: state_payload(ns, s, 4)})
    for r in range(30):
        for s in hot:
            h.now[0] += 0.01
            _, a = h.lookup(s + [1], lease=False)
            assert a.state_tokens == 4
            kv, snap = h.read_prefix(s + [1], a, 4)  # reads are what eviction counts as use
            assert snap == state_payload(ns, s, 4)
        for k in range(3):  # one-offs, never looked up: evicted unreused
            h.now[0] += 0.01
            one_off = [50_000 + 12 * r + 4 * k + j for j in range(4)]
            h.save(one_off, 4, {4: state_payload(ns, one_off, 4)})
    h.store.check()
    fresh = [99_000, 99_001, 99_002, 99_003]
    h.save(fresh, 4)
    assert statuses(h, fresh, 4, {4: Origin.PROMPT_END}) == ["have", "rejected"]  # second-hit mode now
