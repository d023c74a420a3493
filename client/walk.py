"""A cluster lookup: walk the prompt's branches, merge the levels into the single-node answer.

The prefix tree is placed by branches (protocol/placement.py): a level's home holds all of it,
a conversation's levels share one home, and a fork head's branch lives on the node its hash
ranks first. A lookup therefore asks few nodes, one after the other (protocol/probe.py)::

    hop 1   branch node of h_1 (rank(h_1))        levels 0, 1, ... k   (k: the prompt forks there)
    hop 2   branch node of h_{k+1}                levels k, k+1, ... m (m: the match ends there)
            ...                                   hops = forks along the prompt, not N

Each node answers the levels it is the home of exactly (``exact``); the first level of a hop
that starts at a fork head is answered by the head's branch node, which holds the head but not
the rest of that level. Where an exact answer can change the result, the walk asks the home
(at most a few follow-ups, only on these paths):

* the level that ends the match was answered by a node that is not its home (the branch node
  of h_1 does not hold it; a node holding hot copies does not hold the next block): the home
  (for a copy, first the branch node of the next block, in case it is a fork head there);
* a child that is a fork record (its payload on its own branch node): that node confirms it;
* a level answered only by a non-home, in a namespace with state, when nothing at or above it
  beats what the level could hold: its home, for the snapshots registered there (the root
  level's snapshots -- a system prompt shorter than one block -- are the usual case).

Merged as one node would (DESIGN §5): m = the first level whose next block no node holds in
full; kv = m·B + usable tokens of level m's best child; state = the largest snapshot boundary of
levels 0..m that kv reaches; hint = kv when kv > state (with state). Exact by construction when
every home answers; a dead home's levels are misses (the match stops there), never wrong bytes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from ..protocol.hashing import BlockHash
from ..protocol.placement import root_branch
from ..protocol.probe import TIER_ELSEWHERE, LevelAnswer, ProbeAnswer, ProbeLevel
from ..protocol.wire import EntryRef
from .prompt import Prompt

MAX_HOPS = 12
"""Probes one lookup sends at most (hops along forks and follow-ups). A prompt forking more often
than this is answered up to where the walk stopped: lower, never wrong."""

Hop = Callable[[bytes, Sequence[ProbeLevel], bytes | None], Awaitable[list[tuple[str, ProbeAnswer]]]]
"""``(branch key, levels, first entry key) -> [(node, answer)]``: ask a live home of the branch (or a
node holding copies of the first entry), within owner_grace_s also the previous owner; [] when none
answered (client/cluster.py)."""


@dataclass
class LevelState:
    """What the walk learned about one level of the prompt."""

    held_at: str | None = None  # a node holding the prompt's next block in full
    fork: bool = False  # the level's home holds the next block as a fork record
    exact: bool = False  # the level's home answered it
    children: list[tuple[EntryRef, str]] = field(default_factory=list)  # (child, node that reported it)
    snapshots: list[tuple[EntryRef, str]] = field(default_factory=list)


@dataclass
class Walk:
    prompt: Prompt
    levels: list[ProbeLevel]
    hop: Hop
    has_state: bool
    states: list[LevelState] = field(default_factory=list)
    branch_of: list[bytes | None] = field(default_factory=list)  # level -> branch key of its home
    answered: list[tuple[str, ProbeAnswer]] = field(default_factory=list)
    probes: int = 0
    nodes: set[str] = field(default_factory=set)  # nodes that answered (cluster_scale counts them)

    def __post_init__(self) -> None:
        self.states = [LevelState() for _ in self.levels]
        self.branch_of = [None] * len(self.levels)
        if self.levels:
            self.branch_of[0] = root_branch(self.prompt.root, self.levels[0].tokens)

    @property
    def n(self) -> int:
        """Full blocks of the prompt (levels 0..n-1 have a next block; level n, if any, is its tail)."""
        return len(self.prompt.hashes)

    # ------------------------------------------------------------ asking

    async def _ask(self, branch: bytes, start: int, stop: int | None = None) -> list[tuple[int, LevelAnswer]]:
        """One probe of levels [start, stop) on ``branch``; the answers absorbed, the last per node."""
        if self.probes >= MAX_HOPS:
            return []
        self.probes += 1
        levels = self.levels[start:stop]
        first = self.prompt.block_key(start) if levels and levels[0].next else None
        got = await self.hop(branch, levels, first)
        lasts: list[tuple[int, LevelAnswer]] = []
        for url, answer in got:
            self.answered.append((url, answer))
            self.nodes.add(url)
            for la in answer.levels:
                self._absorb(url, la, branch, start)
            if answer.levels:
                lasts.append((len(answer.levels), answer.levels[-1]))
        return lasts

    def head_hop(self, branch: bytes, start: int) -> bool:
        """Whether a hop asks the branch node of the fork head at level ``start`` (the prompt's block
        h_{start+1} is the branch key): that node holds the head, not the rest of level ``start``."""
        return start < self.n and self.prompt.hashes[start] == branch

    def _absorb(self, url: str, la: LevelAnswer, branch: bytes, start: int) -> None:
        j = la.level
        if not start <= j < len(self.states):
            return
        st = self.states[j]
        if la.held and not la.fork and st.held_at is None:
            st.held_at = url
        st.fork = st.fork or la.fork
        st.exact = st.exact or la.exact
        if la.child is not None:
            st.children.append((la.child, url))
        if la.snapshot is not None:
            st.snapshots.append((la.snapshot, url))
        if j > start or not self.head_hop(branch, start):
            self.branch_of[j] = branch  # homed on this hop's branch
        if la.fork and j + 1 < len(self.levels):
            self.branch_of[j + 1] = self.prompt.hashes[j]  # the fork head's branch holds the next level

    async def run(self) -> None:
        """Walk the branches from the prompt's first block (module docstring), then follow up."""
        if not self.levels:
            return
        branch = self.prompt.hashes[0] if self.n else self.branch_of[0]
        assert branch is not None
        start = 0
        tried: set[tuple[bytes, int]] = set()
        while self.probes < MAX_HOPS:
            tried.add((branch, start))
            lasts = await self._ask(branch, start)
            if not lasts:
                # No node of this branch answered. A fork head's branch: its home's answer stands (the
                # match ends at its level). The branch node of h_1: the root level's home still knows level 0.
                home = self.branch_of[start]
                if self.states[start].exact or home is None or (home, start) in tried:
                    break
                branch = home
                continue
            _, last = max(lasts, key=lambda x: (x[1].level, x[1].held))
            j = last.level
            if last.held and last.fork:
                head = BlockHash(self.levels[j].next)
                if (head, j) in tried:
                    break  # its branch node did not confirm it: the match ends at level j (the home's child)
                branch, start = head, j
                continue
            if last.held or self.states[j].exact:
                break
            # Level j was answered by a node that is not its home and does not hold the next block: the
            # branch node of a fork head that has lost it, or a node holding copies of this branch.
            nxt = BlockHash(self.levels[j].next) if self.levels[j].next else None
            if nxt is not None and (nxt, j) not in tried and not (j == start and self.head_hop(branch, start)):
                branch, start = nxt, j  # a copy: the next block may be a fork head on its own branch node
                continue
            home = self.branch_of[j]
            if home is None or (home, j) in tried:
                break
            branch, start = home, j
        await self._confirm_child()
        await self._snapshots()

    def matched(self) -> int:
        m = 0
        while m < self.n and self.states[m].held_at is not None:
            m += 1
        return m

    def best_child(self, m: int) -> tuple[EntryRef, str] | None:
        if m >= len(self.states):
            return None
        kids = [(c, u) for c, u in self.states[m].children if c.usable_tokens > 0]
        return max(kids, key=lambda cu: (cu[0].usable_tokens, cu[0].tier != TIER_ELSEWHERE)) if kids else None

    async def _confirm_child(self) -> None:
        """A best child that is a fork record is read from its branch node: ask that node to confirm
        (and lease) it; if it cannot, the record is stale and the next best child stands."""
        for _ in range(2):
            m = self.matched()
            best = self.best_child(m)
            if best is None or best[0].tier != TIER_ELSEWHERE:
                return
            ref = best[0]
            st = self.states[m]
            st.children = [(c, u) for c, u in st.children if c is not ref]
            head = ref.key[1:]
            await self._ask(head, m, m + 1)
            # the branch node's answer, if any, was absorbed: it names the child as held there

    async def _snapshots(self) -> None:
        """Levels no home answered may hold a snapshot that beats what was found (module docstring)."""
        if not self.has_state:
            return
        B = self.prompt.block_tokens
        while self.probes < MAX_HOPS:
            m = self.matched()
            kv = self.kv_tokens(m)
            best = self.state_tokens(m, kv)
            todo = [j for j in range(min(m, len(self.levels) - 1), -1, -1)
                    if not self.states[j].exact and best <= j * B < kv and self.branch_of[j] is not None]
            if not todo:
                return
            j = todo[0]
            branch = self.branch_of[j]
            assert branch is not None
            self.states[j].exact = True  # asked once, whatever the answer
            await self._ask(branch, j, j + 1)

    # ------------------------------------------------------------ the merge

    def kv_tokens(self, m: int) -> int:
        best = self.best_child(m)
        usable = best[0].usable_tokens if best is not None and best[0].tier != TIER_ELSEWHERE else 0
        return m * self.prompt.block_tokens + usable

    def state_tokens(self, m: int, kv: int) -> int:
        best = self.best_snapshot(m, kv)
        return best[0].usable_tokens if best is not None else 0

    def best_snapshot(self, m: int, kv: int) -> tuple[EntryRef, str] | None:
        found = [(s, u) for j in range(min(m, len(self.states) - 1) + 1) for s, u in self.states[j].snapshots
                 if s.usable_tokens <= kv]
        return max(found, key=lambda su: su[0].usable_tokens) if found else None

    def child(self, m: int) -> tuple[EntryRef, str] | None:
        best = self.best_child(m)
        return best if best is not None and best[0].tier != TIER_ELSEWHERE else None

    def leases(self) -> list[tuple[str, bytes]]:
        return [(url, a.lease_id) for url, a in self.answered if a.lease_id is not None]


def probe_levels(p: Prompt) -> list[ProbeLevel]:
    """A prompt's levels: one per full block (with its hash as next), one more for a tail."""
    B, n, T = p.block_tokens, len(p.hashes), p.num_tokens
    levels: list[ProbeLevel] = []
    for j in range(n + 1):
        seg = p.tokens(j * B, min((j + 1) * B, T))
        if j == n and not seg:
            break
        levels.append(ProbeLevel(level=j, parent=p.parent_of_block(j), next=p.hashes[j] if j < n else b"",
                                 tokens=seg, extra=p.extra_keys[j] if j < len(p.extra_keys) else b""))
    return levels


__all__ = ["MAX_HOPS", "Hop", "LevelState", "Walk", "probe_levels"]
