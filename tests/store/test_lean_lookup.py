"""Lean lookups (protocol/match.py, protocol/wire.py LookupRequest.spans): a request that carries the
block hashes and only some levels' tokens gets the answer a whole-prompt request gets, or is told
the one level it must carry; a malformed one is a 4xx naming the field.

B = 4 tokens (tests/store/test_metric_values.py's namespace).
"""

from __future__ import annotations

import pytest

from prefixstore.client.prompt import Prompt
from prefixstore.protocol.match import lean_levels, span_tokens
from prefixstore.protocol.wire import Limits, LookupRequest, WireError

from ..factories import state_payload
from .test_metric_values import harness, ns, ram_only, value

__all__ = ["harness", "ns"]  # fixtures

LONG = list(range(100, 132))  # 32 tokens: 8 blocks of 4


def lean_request(p: Prompt, spans: tuple[tuple[int, int], ...], lease: bool = False) -> LookupRequest:
    return LookupRequest(namespace_id=p.namespace.id, hashes=p.hash_bytes,
                         tokens=span_tokens(p.packed, p.block_tokens, spans), spans=spans,
                         total_tokens=p.num_tokens, lease=lease)


def test_lean_levels_carry_level_0_the_window_and_what_was_asked() -> None:
    assert lean_levels(10, 4, 8) == ((0, 1), (8, 2))
    assert lean_levels(10, 4, 0) == ((0, 1), (9, 1))  # the last level always: a tail is compared there
    assert lean_levels(10, 4, 8, [3, 4]) == ((0, 1), (3, 2), (8, 2))
    assert lean_levels(3, 4, 1024) == ((0, 3),)
    assert lean_levels(0, 4, 8) == ()


def test_a_snapshot_in_a_tail_under_a_held_level_is_found_without_that_levels_tokens(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """A snapshot at 14 lives in the tail [12, 14) under h_3. A later save stores blocks to 32, so
    level 3 is held by the prompt's own block; the lean request does not carry level 3's tokens,
    and the store compares the tail with the held block's tokens (equal hashes, equal tokens).
    Plant: compare with no tokens (b"") -> state_tokens 0."""
    h = harness(ram_only(), ns)
    h.save(LONG[:14], 14, {14: state_payload(ns, LONG, 14)})
    h.save(LONG, 32)
    prompt = LONG + [7, 7, 7, 7, 7, 7]  # 38 tokens: 9 full blocks; stops at level 8, carried
    p = Prompt(ns, prompt)
    spans = lean_levels(10, 4, 4)
    assert 3 not in {j for first, count in spans for j in range(first, first + count)}
    lean = h.store.lookup(lean_request(p, spans))
    _, whole = h.lookup(prompt, lease=False)
    assert lean.need_level is None
    assert (lean.kv_tokens, lean.state_tokens) == (whole.kv_tokens, whole.state_tokens) == (32, 14)


def test_a_stop_outside_the_carried_levels_asks_for_that_level_and_nothing_else(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """The last turn saved 22 tokens (5 blocks and a tail of 2); the next prompt shares them and goes
    on for 28 more tokens, so its match stops at level 5, past level 0 and before the last 4 tokens'
    level. The store asks for level 5 -- no lease, nothing counted -- and answers 22 tokens exactly
    once it has them. Plant: treat an uncarried stop level as one with nothing to compare -> 20."""
    h = harness(ram_only(), ns)
    h.save(LONG[:22], 22, {22: state_payload(ns, LONG, 22)})
    prompt = LONG[:22] + list(range(500, 528))  # 50 tokens
    p = Prompt(ns, prompt)
    B = ns.block_tokens
    spans = lean_levels(-(-len(prompt) // B), B, 4)
    lookups_before = value(h.store, "prefixstore_lookups_total")
    first = h.store.lookup(lean_request(p, spans, lease=True))
    assert first.need_level == 5
    assert first.lease_id is None and first.kv_tokens == 0
    assert value(h.store, "prefixstore_lookups_total") == lookups_before  # nothing learned yet
    second = h.store.lookup(lean_request(p, lean_levels(-(-len(prompt) // B), B, 4, [5]), lease=True))
    _, whole = h.lookup(prompt, lease=False)
    assert second.need_level is None
    assert (second.kv_tokens, second.state_tokens, second.checkpoint_hint) == \
        (whole.kv_tokens, whole.state_tokens, whole.checkpoint_hint) == (22, 22, 0)
    assert second.child is not None and second.child.usable_tokens == 2
    assert second.lease_id is not None


def test_a_stop_with_nothing_stored_under_it_needs_no_tokens(ns, harness) -> None:  # type: ignore[no-untyped-def]
    """Blocks to 20 stored, nothing under h_5: a lean lookup that stops at level 5 without its tokens
    is answered at once (20 tokens), no second trip."""
    h = harness(ram_only(), ns)
    h.save(LONG[:20], 20)
    p = Prompt(ns, LONG[:20] + list(range(500, 528)))
    a = h.store.lookup(lean_request(p, lean_levels(12, 4, 4)))
    assert a.need_level is None and a.kv_tokens == 20


@pytest.mark.parametrize(("spans", "tokens", "field"), [
    ([[0, 1], [0, 1]], 8, "spans[1]"),  # overlapping
    ([[3, 1], [1, 1]], 8, "spans[1]"),  # descending
    ([[0, 11]], 40, "spans[0]"),  # past the prompt's 10 levels
    ([[0, 0]], 0, "spans[0]"),  # empty span
    ([[0, 1]], 8, "tokens"),  # 4 tokens named, 8 carried
    ([[9, 1]], 4, "tokens"),  # the last level is partial: 2 tokens named
    ("x", 4, "spans"),
])
def test_malformed_spans_are_refused_naming_the_field(ns, spans: object, tokens: int, field: str) -> None:  # type: ignore[no-untyped-def]
    p = Prompt(ns, list(range(38)))
    header = {"ns": ns.id, "hashes": p.hash_bytes, "tokens": p.packed[: tokens * 4], "spans": spans,
              "total_tokens": 38}
    with pytest.raises(WireError) as err:
        LookupRequest.from_header(header, Limits(), lambda _: 4)
    assert err.value.field == field, err.value


def test_total_tokens_must_agree_with_the_hashes(ns) -> None:  # type: ignore[no-untyped-def]
    p = Prompt(ns, list(range(38)))
    header = {"ns": ns.id, "hashes": p.hash_bytes, "tokens": p.packed[:16], "spans": [[0, 1]], "total_tokens": 60}
    with pytest.raises(WireError) as err:
        LookupRequest.from_header(header, Limits(), lambda _: 4)
    assert err.value.field == "hashes"
