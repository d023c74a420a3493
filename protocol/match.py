"""The match rule of DESIGN §5, written once: runs of levels, and the one merge that answers from them.

A prompt's **level** j is its parent hash h_j (h_0: the namespace root), its next block h_{j+1}
(none at a last, partial level) and its tokens of that block, [jB, min((j+1)B, T)). What one node
knows of the levels from s on is a **run** (:class:`Run`)::

    held        levels s .. s+k-1: their next block is stored there in full, each under the one before
    stop        level s+k, when it was answered: ``fork`` (its next block is held there only as a fork
                record: the prompt goes on at that block's branch node) or not, and ``child``: the
                stored child (block or tail) whose tokens agree longest with the level's, and how many
    snapshots   per level: the snapshot registered under it whose container agrees with the prompt up
                to its boundary, the largest boundary the level's KV reaches ((j+1)B for a held level,
                jB + the child's agreeing tokens at the stop)

A single node's lookup is one run from level 0 (store/lookups.py); a cluster node's probe is one
run from the level it is asked (protocol/probe.py carries it); a cluster lookup gathers the runs
of the nodes it walks (client/walk.py). The store's index yields them (store/index.py
``Index.run``); all three callers answer with :func:`merge`::

    matched         m: the first level that no run holds
    kv_tokens       m·B + the agreeing tokens of the best child at level m -- not a fork record's:
                    its payload is on its branch node, which confirms it (then it is held there)
    state_tokens    the largest boundary of a snapshot at a level <= m that kv_tokens reaches
    checkpoint_hint kv_tokens, when it is past state_tokens on a model with state: the junction the
                    store has now seen twice without a snapshot (cache on second sighting)

Pure: no I/O, no clock. The entries a run names are the caller's (the store's index entries, the
client's answer references): :class:`Hit` carries one with the tokens it gives this prompt.

The request side is :class:`Levels`: the prompt from some level on as a matcher reads it (the
next block's hash, the level's tokens, its extra keys). A matcher needs a level's tokens only where
it compares them with a stored child's: at the stop level (its children, the snapshots in them).
A held level's tokens are the stored block's (its hash was recomputed from them when it was put,
and equal hashes mean equal tokens: the xxh3-128 threat model that already matches full blocks by
hash), so a request may carry only some levels' tokens (:attr:`Levels.spans`). When the stop level
is one it did not carry and a comparison is due there, the matcher says which level it needs
(store/index.py ``IndexRun.needs``) and the client asks again with it: :func:`lean_levels` is the
client's choice of what to send first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .hashing import HASH_BYTES, TOKEN_BYTES

E = TypeVar("E")


@dataclass(frozen=True, slots=True)
class Levels:
    """Levels ``start`` .. of one prompt: ``parent`` = h_start (the root at level 0), ``hashes`` =
    h_{start+1} .. h_{start+k} concatenated (the levels with a next block), ``tokens`` = the prompt's
    tokens from start·B on, packed uint32; ``extras`` maps a level j to the extra keys of the
    prompt's block j+1 (LoRA, images), sparse."""

    start: int
    parent: bytes
    hashes: bytes
    tokens: bytes
    block_tokens: int
    extras: Mapping[int, bytes] = field(default_factory=dict)
    spans: tuple[tuple[int, int], ...] | None = None
    """Which levels ``tokens`` holds: (first level, number of levels) from ``start``, ascending and
    disjoint, the levels' tokens concatenated in that order; None: every level's (``tokens`` is the
    prompt from ``start``·B on)."""
    total_tokens: int = -1  # the prompt's tokens from start·B on; -1: len(tokens) (spans is None)

    @property
    def num_blocks(self) -> int:
        """Levels with a next block (full blocks of the prompt from ``start`` on)."""
        return len(self.hashes) // HASH_BYTES

    @property
    def num_tokens(self) -> int:
        """The prompt's tokens from ``start``·B on (carried or not)."""
        return len(self.tokens) // TOKEN_BYTES if self.total_tokens < 0 else self.total_tokens

    @property
    def num_levels(self) -> int:
        """Every level: the full blocks and, when tokens follow them, one partial level."""
        k = self.num_blocks
        return k + (1 if self.num_tokens > k * self.block_tokens else 0)

    def next_hash(self, i: int) -> bytes:
        """h_{start+i+1}: the prompt's next block at level start+i (i < num_blocks)."""
        return self.hashes[i * HASH_BYTES : (i + 1) * HASH_BYTES]

    def parent_of(self, i: int) -> bytes:
        """h_{start+i}: the parent hash of level start+i."""
        return self.parent if i == 0 else self.hashes[(i - 1) * HASH_BYTES : i * HASH_BYTES]

    def segment(self, i: int) -> bytes | None:
        """The prompt's tokens of level start+i, packed; None when the request did not carry them."""
        span = self.block_tokens * TOKEN_BYTES
        if self.spans is None:
            return self.tokens[i * span : (i + 1) * span]
        at = 0  # levels before i's span, in the concatenation (a handful of spans: a scan)
        for first, count in self.spans:
            if first <= i < first + count:
                return self.tokens[(at + i - first) * span : (at + i - first + 1) * span]
            at += count
        return None

    def extra(self, j: int) -> bytes:
        """Extra keys of the prompt's block j+1 (``j`` an absolute level)."""
        return self.extras.get(j, b"")


@dataclass(frozen=True, slots=True)
class Hit(Generic[E]):
    """An entry a run names, with what it gives this prompt: a child's tokens that agree with the
    level's, a snapshot's boundary."""

    entry: E
    tokens: int
    elsewhere: bool = False  # a fork record: its payload is on its branch node


@dataclass(frozen=True, slots=True, kw_only=True)
class Run(Generic[E]):
    """What one node knows of levels ``start`` .. (module docstring)."""

    start: int
    held: int = 0  # levels start .. start+held-1 hold their next block in full
    stopped: bool = False  # level start+held was answered (fork, child)
    fork: bool = False  # its next block is a fork record here: the prompt goes on at its branch node
    child: Hit[E] | None = None  # its best child (the match ends inside it)
    snapshots: Mapping[int, Hit[E]] = field(default_factory=dict)  # level -> its best snapshot

    @property
    def stop(self) -> int:
        """The level after the held ones (answered when ``stopped``)."""
        return self.start + self.held


@dataclass(frozen=True, slots=True, kw_only=True)
class Match(Generic[E]):
    """The merged answer (DESIGN §5): the single-node answer, whoever's runs it merged."""

    matched: int  # full blocks matched (m)
    kv_tokens: int
    state_tokens: int
    checkpoint_hint: int
    child: Hit[E] | None  # the child the match ends inside (None: it ends at a block boundary)
    snapshot: Hit[E] | None  # the snapshot at state_tokens


def matched(runs: Sequence[Run[E]], num_blocks: int) -> int:
    """The first level of [0, num_blocks) that no run holds (m)."""
    m = 0
    grown = True
    while grown and m < num_blocks:  # a handful of runs: a pass per run that extends m
        grown = False
        for r in runs:
            if r.start <= m < r.start + r.held:
                m = min(r.start + r.held, num_blocks)
                grown = True
    return m


def best_child(runs: Sequence[Run[E]], level: int) -> Hit[E] | None:
    """The child that agrees longest at ``level`` among the runs that stop there; on a tie one that is
    no fork record, then the first reported."""
    best: Hit[E] | None = None
    for r in runs:
        c = r.child
        if c is None or not r.stopped or r.stop != level or c.tokens <= 0:
            continue
        if best is None or (c.tokens, not c.elsewhere) > (best.tokens, not best.elsewhere):
            best = c
    return best


def merge(runs: Sequence[Run[E]], *, block_tokens: int, num_blocks: int, has_state: bool) -> Match[E]:
    """The answer the runs make together (module docstring)."""
    m = matched(runs, num_blocks)
    child = best_child(runs, m)
    if child is not None and child.elsewhere:
        child = None  # not confirmed by its branch node: no KV of it here
    kv = m * block_tokens + (child.tokens if child is not None else 0)
    snapshot: Hit[E] | None = None
    for r in runs:
        for j, s in r.snapshots.items():
            if j <= m and s.tokens <= kv and (snapshot is None or s.tokens > snapshot.tokens):
                snapshot = s
    state = snapshot.tokens if snapshot is not None else 0
    hint = kv if has_state and kv > state else 0
    return Match(matched=m, kv_tokens=kv, state_tokens=state, checkpoint_hint=hint, child=child, snapshot=snapshot)


def lean_levels(num_levels: int, block_tokens: int, window_tokens: int,
                also: Sequence[int] = ()) -> tuple[tuple[int, int], ...]:
    """The levels whose tokens a lean lookup carries first, as spans (:attr:`Levels.spans`): level 0
    (a cold prompt stops there, and a cluster places the root branch by it), the levels of the last
    ``window_tokens`` tokens (a conversation's next turn stops where the last turn's save ended: in
    its new message, near the end), and ``also`` (the levels a store said it needs). Anywhere else
    the stop costs one more round trip; a prompt held in full needs no tokens at all but a tail's."""
    if num_levels <= 0:
        return ()
    tail_from = max(0, num_levels - max(1, -(-window_tokens // block_tokens)))
    # Spans, not a set of levels: the window may be thousands of levels, the rest a handful.
    spans: list[tuple[int, int]] = []
    for first, count in sorted([(0, 1), (tail_from, num_levels - tail_from),
                                *((j, 1) for j in also if 0 <= j < num_levels)]):
        if spans and first <= spans[-1][0] + spans[-1][1]:
            last_first, last_count = spans[-1]
            spans[-1] = (last_first, max(last_count, first + count - last_first))
        else:
            spans.append((first, count))
    return tuple(spans)


def span_tokens(tokens: bytes, block_tokens: int, spans: Sequence[tuple[int, int]]) -> bytes:
    """The packed ``tokens`` (a prompt from its first level on) of the levels ``spans`` names, concatenated."""
    span = block_tokens * TOKEN_BYTES
    return b"".join(tokens[first * span : (first + count) * span] for first, count in spans)


__all__ = ["Hit", "Levels", "Match", "Run", "best_child", "lean_levels", "matched", "merge", "span_tokens"]
