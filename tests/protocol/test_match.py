"""The match rule's one merge (protocol/match.py), on runs written by hand: what each level gives."""

from __future__ import annotations

from prefixstore.protocol.match import Hit, Run, best_child, matched, merge

B = 4


def test_matched_is_the_first_level_no_run_holds_whatever_the_order_and_overlap() -> None:
    runs = [Run(start=5, held=3), Run(start=0, held=2), Run(start=2, held=4), Run(start=9, held=4)]
    assert matched(runs, 20) == 8  # 0-2, 2-6, 5-8 chain; 9.. is past the gap at 8
    assert matched(runs[:2], 20) == 2
    assert matched([Run(start=0, held=30)], 20) == 20  # never past the prompt's blocks
    assert matched([], 20) == 0


def test_kv_is_the_matched_blocks_and_the_best_child_at_that_level() -> None:
    runs = [Run(start=0, held=3, stopped=True, child=Hit("a", 2)),
            Run(start=3, held=0, stopped=True, child=Hit("b", 3)),
            Run(start=1, held=1, stopped=True, child=Hit("c", 4))]  # stops at level 2: not the match's level
    m = merge(runs, block_tokens=B, num_blocks=10, has_state=False)
    assert (m.matched, m.kv_tokens, m.checkpoint_hint) == (3, 3 * B + 3, 0)
    assert m.child is not None and m.child.entry == "b"


def test_a_fork_records_child_counts_for_nothing_until_its_branch_node_confirms_it() -> None:
    record = Run(start=0, held=2, stopped=True, fork=False, child=Hit("record", 3, elsewhere=True))
    m = merge([record], block_tokens=B, num_blocks=10, has_state=True)
    assert (m.kv_tokens, m.child) == (2 * B, None)
    # A stored child as long as the record wins the tie; a longer record still stands as the best
    # (the walk confirms it with its branch node, or drops it, before the last merge).
    tie = Run(start=2, held=0, stopped=True, child=Hit("block", 3))
    got = best_child([record, tie], 2)
    assert got is not None and got.entry == "block"
    assert merge([record, tie], block_tokens=B, num_blocks=10, has_state=True).kv_tokens == 2 * B + 3


def test_state_is_the_largest_boundary_at_or_below_the_match_that_kv_reaches() -> None:
    runs = [Run(start=0, held=2, stopped=True, child=Hit("c", 1),
                snapshots={0: Hit("s3", 3), 1: Hit("s7", 7), 2: Hit("s10", 10)}),  # 10 > kv = 9
            Run(start=3, held=2, snapshots={3: Hit("s13", 13)})]  # past the match (m = 2)
    m = merge(runs, block_tokens=B, num_blocks=10, has_state=True)
    assert (m.matched, m.kv_tokens, m.state_tokens, m.checkpoint_hint) == (2, 9, 7, 9)
    assert m.snapshot is not None and m.snapshot.entry == "s7"
    plain = merge(runs, block_tokens=B, num_blocks=10, has_state=False)
    assert plain.checkpoint_hint == 0  # no hint on a model without state
    at_kv = merge([Run(start=0, held=2, snapshots={1: Hit("s8", 8)})], block_tokens=B, num_blocks=2, has_state=True)
    assert (at_kv.kv_tokens, at_kv.state_tokens, at_kv.checkpoint_hint) == (8, 8, 0)  # a snapshot at kv: no hint


def test_a_run_cut_anywhere_merges_to_the_same_answer() -> None:
    """A walk asks a branch in pieces (hops sent early stop where the next one starts): the runs of
    the pieces merge to the run of the whole."""
    whole = Run(start=0, held=6, stopped=True, child=Hit("c", 2), snapshots={4: Hit("s18", 18), 6: Hit("s25", 25)})
    want = merge([whole], block_tokens=B, num_blocks=8, has_state=True)
    for cut in range(1, 6):
        first = Run(start=0, held=cut, snapshots={j: h for j, h in whole.snapshots.items() if j < cut})
        rest = Run(start=cut, held=6 - cut, stopped=True, child=whole.child,
                   snapshots={j: h for j, h in whole.snapshots.items() if j >= cut})
        assert merge([first, rest], block_tokens=B, num_blocks=8, has_state=True) == want, cut
        assert merge([rest, first], block_tokens=B, num_blocks=8, has_state=True) == want, cut
