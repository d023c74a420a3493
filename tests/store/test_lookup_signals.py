"""What a lookup teaches the eviction policy and the FLOP counter, and the tier map it answers.

Written against the survivors of a mutation sample of store/lookups.py (docs/testing.md):
the first missing block handed to the eviction's ghost signal, the junction miss, the
``prefixstore_prefill_flops_saved`` value, and ``block_tiers`` only when asked for.
Same namespace as tests/store/test_metric_values.py: B = 4 tokens, 16-byte snapshots.
"""

from __future__ import annotations

from prefixstore.client.prompt import Prompt
from prefixstore.protocol import Kind
from prefixstore.protocol.wire import LookupRequest

from ..factories import make_namespace, state_payload
from .test_metric_values import A, harness, ns, ram_only, value

__all__ = ["harness", "ns"]  # fixtures


def test_a_lookup_tells_eviction_which_block_and_junction_it_missed(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """KV of blocks 0 and 1 stored, no snapshot. A 12-token lookup matches 8 tokens: it
    misses block 2 (the ghost signal FLOP-aware eviction tunes on) and reaches the
    junction at 8 without a snapshot (block 1's key, a snapshot's would-be key)."""
    h = harness(ram_only(eviction="flop-aware"), ns)
    h.save(A[:8], 8)
    calls: list[tuple[Kind, bytes]] = []
    h.store.eviction.on_miss = lambda kind, key, now: calls.append((kind, key))  # type: ignore[method-assign]
    tokens = A + [11, 12, 13, 14, 15, 16]  # 4 blocks: the first missing one is block 2 alone
    p, a = h.lookup(tokens)
    assert (a.matched_blocks, a.kv_tokens, a.state_tokens) == (2, 8, 0)
    assert calls == [(Kind.STATE, ns.id + p.hashes[1]), (Kind.BLOCK, ns.id + p.hashes[2])]

    calls.clear()
    p, a = h.lookup(A[:8])  # everything asked for is there: no block missed, no junction
    assert (a.matched_blocks, a.kv_tokens) == (2, 8)
    assert calls == [(Kind.STATE, ns.id + p.hashes[1])]  # KV to 8, no snapshot at 8: still a junction


def test_prefill_flops_saved_counts_the_exactly_reusable_prefix(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """Hybrid: the FLOPs of the state-reusable prefix (10, then 4 tokens); KV-only: of the KV match."""
    h = harness(ram_only(), ns)
    h.save(A, 10, {4: state_payload(ns, A, 4), 10: state_payload(ns, A, 10)})
    h.lookup(A + [90, 91])  # state to 10
    h.lookup(A[:6] + [50, 51])  # KV to 6, state to 4
    shape = h.store.shape_of(ns.id)
    assert shape is not None
    expected = shape.prefill_flops(10) + shape.prefill_flops(4)
    assert expected > 0
    assert value(h.store, "prefixstore_prefill_flops_saved_total") == expected

    plain = make_namespace(block_tokens=4, with_state=False, model="kv-only")
    k = harness(ram_only(), plain)
    k.save(A[:8], 8)
    k.lookup(A)  # KV to 8
    kshape = k.store.shape_of(plain.id)
    assert kshape is not None
    assert value(k.store, "prefixstore_prefill_flops_saved_total") == kshape.prefill_flops(8) > 0


def test_block_tiers_only_when_locations_are_asked_for(ns, harness) -> None:  # type: ignore[no-untyped-def]
    h = harness(ram_only(), ns)
    h.save(A[:8], 8)
    p = Prompt(ns, A + [11, 12, 13, 14, 15, 16])  # 4 blocks asked for, 2 matched

    def ask(locations: bool):  # type: ignore[no-untyped-def]
        return h.store.lookup(LookupRequest(namespace_id=ns.id, hashes=b"".join(p.hashes), tokens=p.packed,
                                            lease=False, locations=locations))

    assert ask(False).block_tiers is None
    assert ask(True).block_tiers == bytes([0, 0])  # both matched blocks in RAM
    nothing = Prompt(ns, [70, 71, 72, 73])
    a = h.store.lookup(LookupRequest(namespace_id=ns.id, hashes=b"".join(nothing.hashes), tokens=nothing.packed,
                                     lease=False, locations=True))
    assert (a.matched_blocks, a.block_tiers) == (0, None)


def test_no_checkpoint_hint_when_the_snapshot_covers_the_kv_match(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A long prefix (300 tokens, past the small ints Python shares) with its snapshot: the
    KV match and the state match are equal, so there is no junction to hint at."""
    h = harness(ram_only(), ns)
    long = list(range(1000, 1300))
    h.save(long, 300, {300: state_payload(ns, long, 300)})
    _, a = h.lookup(long + [5])
    assert (a.kv_tokens, a.state_tokens, a.checkpoint_hint) == (300, 300, 0)


def test_deferred_lessons_run_after_the_answer_and_skip_what_was_evicted_meanwhile(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """The HTTP routes answer a lookup first and teach the policies after (``defer``, store/lookups.py).
    The answer is the same, nothing is taught before the lessons run, and a lesson that runs after
    the served block was evicted counts no hit on it: its eviction already told the admission
    policy it had none (a hit counted now would reach no entry, and the policies would hear of a
    use of a block the store no longer holds)."""
    h = harness(ram_only(eviction="flop-aware"), ns)
    h.save(A[:8], 8)
    p = Prompt(ns, A[:8])
    req = LookupRequest(namespace_id=ns.id, hashes=p.hash_bytes, tokens=p.packed, lease=False)
    inline = h.store.lookup(req)
    hits: list[bytes] = []
    h.store.eviction.on_hit = lambda entry, now: hits.append(entry.key)
    before = value(h.store, "prefixstore_lookups_total")

    lessons: list[object] = []
    answer = h.store.lookup(req, lessons.append)
    assert answer == inline and len(lessons) == 1
    assert value(h.store, "prefixstore_lookups_total") == before and hits == []  # nothing taught yet
    lessons.pop()()  # type: ignore[operator]
    assert value(h.store, "prefixstore_lookups_total") == before + 1
    served = h.store.index.get_block(ns.id, p.hashes[1])
    assert served is not None and hits == [served.key]

    hits.clear()
    answer = h.store.lookup(req, lessons.append)
    assert answer == inline
    h.store.space.evict(served, 0.0)  # between the answer and its lessons
    assert h.store.index.get(served.key) is None
    lessons.pop()()  # type: ignore[operator]
    assert hits == []  # no hit on the evicted block
    assert value(h.store, "prefixstore_lookups_total") == before + 2  # the lookup itself still counts


def test_a_namespace_asked_about_before_it_is_registered_gets_its_shape_once_it_is(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A lesson deferred past its namespace's removal (a failed registration rolled back) asks for
    the shape of an id the store does not know: that answer (None) must not stick, or the
    namespace, registered again, would count no FLOPs saved and rank with no shape."""
    h = harness(ram_only(eviction="flop-aware"), ns)
    other = make_namespace(block_tokens=4, with_state=False, model="registered-later")
    assert h.store.shape_of(other.id) is None
    h.run(h.store.register_namespace(other))
    assert h.store.shape_of(other.id) is not None
