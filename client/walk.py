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

Each answer is a run of levels (protocol/match.py), kept as it came (clipped to the levels asked);
the walk's answer is :func:`protocol.match.merge` of them, the same merge a single node answers
with. Exact by construction when every home answers; a dead home's levels are misses (the match
stops there), never wrong bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from prefixstore.protocol.hashing import TOKEN_BYTES, BlockHash
from prefixstore.protocol.match import Hit, Match, Run, best_child, matched, merge
from prefixstore.protocol.placement import root_branch
from prefixstore.protocol.probe import TIER_ELSEWHERE, ProbeAnswer, ProbeRequest
from prefixstore.protocol.wire import EntryRef
from .prompt import Prompt

MAX_EARLY = 2
"""Hops sent early, beside the first, from an earlier walk's forks."""
MAX_HOPS = 12
"""Probes one lookup sends at most (hops along forks and follow-ups). A prompt forking more often
than this is answered up to where the walk stopped: lower, never wrong."""

Hop = Callable[[bytes, ProbeRequest, bytes | None], Awaitable[list[tuple[str, ProbeAnswer]]]]
"""``(branch key, request, first entry key) -> [(node, answer)]``: ask a live home of the branch (or a
node holding copies of the first entry), within owner_grace_s also the previous owner; [] when none
answered (client/cluster.py)."""

Found = tuple[EntryRef, str]  # an entry and the node that reported it


@dataclass
class Walk:
    """What the walk learned, per level of the prompt, in flat arrays (a 32k-token prompt has 2,049
    levels: no object per level)."""

    prompt: Prompt
    hop: Hop
    has_state: bool
    held_at: list[str | None] = field(default_factory=list)  # level j -> a node holding block j+1 in full (reads)
    exact: bytearray = field(default_factory=bytearray)  # level j -> 1 when its home answered it
    branch_of: list[bytes | None] = field(default_factory=list)  # level -> branch key of its home
    runs: list[Run[Found]] = field(default_factory=list)  # every answer, as its run of levels (the merge's input)
    answered: list[tuple[str, ProbeAnswer]] = field(default_factory=list)
    probes: int = 0
    nodes: set[str] = field(default_factory=set)  # nodes that answered (cluster_scale counts them)
    hints: Sequence[int] = ()  # levels where this prompt's block is a fork head an earlier walk followed
    fork_levels: list[int] = field(default_factory=list)  # levels where this walk followed a fork
    sent_early: int = 0  # hops sent at once from the hints
    early_levels: list[int] = field(default_factory=list)  # their levels
    early: dict[tuple[bytes, int], asyncio.Future[list[tuple[str, ProbeAnswer]]]] = field(default_factory=dict)
    sent: list[ProbeRequest] = field(default_factory=list)  # every question handed to ``hop``, in order (diagnostics)

    def __post_init__(self) -> None:
        p = self.prompt
        self.hash_bytes = p.hash_bytes
        L = self.num_levels
        self.held_at = [None] * L
        self.exact = bytearray(L)
        self.branch_of = [None] * L
        if L:
            self.branch_of[0] = root_branch(p.root, p.tokens(0, 1))

    @property
    def n(self) -> int:
        """Full blocks of the prompt (levels 0..n-1 have a next block; level n, if any, is its tail)."""
        return self.prompt.num_blocks

    @property
    def num_levels(self) -> int:
        p = self.prompt
        return self.n + (1 if p.num_tokens > self.n * p.block_tokens else 0)

    # ------------------------------------------------------------ asking

    def request(self, start: int, stop: int | None = None) -> ProbeRequest:
        """Levels [start, stop) of the prompt as one probe."""
        p, B, n = self.prompt, self.prompt.block_tokens, self.n
        stop = self.num_levels if stop is None else min(stop, self.num_levels)
        blocks = min(stop, n) - start
        end_tok = stop * B if stop <= n else p.num_tokens
        extras = tuple((j, e) for j, e in enumerate(p.extra_keys[start:stop], start) if e)
        return ProbeRequest(namespace_id=p.namespace.id, start=start, parent=p.parent_of_block(start),
                            hashes=self.hash_bytes[start * 16:(start + blocks) * 16],
                            tokens=p.packed[start * B * TOKEN_BYTES:end_tok * TOKEN_BYTES], extras=extras)

    async def _ask(self, branch: bytes, start: int, stop: int | None = None, hop: bool = False) -> list[ProbeAnswer]:
        """One probe of levels [start, stop) on ``branch``; the answers absorbed. A hop of the walk
        (``hop``) takes the answer of the same question sent early, if there is one (asked of all
        levels from ``start``: ``stop`` is then not used)."""
        if self.probes >= MAX_HOPS:
            return []
        self.probes += 1
        early = self.early.pop((branch, start), None) if hop else None
        if early is not None:
            self.probes -= 1  # counted when it was sent
            stop = None
            got = await early
        else:
            got = await self._send(branch, self.request(start, stop))
        out = []
        for url, answer in got:
            if answer.start != start:
                continue  # not an answer to this question
            self.answered.append((url, answer))
            self.nodes.add(url)
            self._absorb(url, answer, branch, start, stop)
            out.append(answer)
        return out

    def _send(self, branch: bytes, req: ProbeRequest) -> Awaitable[list[tuple[str, ProbeAnswer]]]:
        """Hand one question to ``hop`` (recorded in ``sent``)."""
        self.sent.append(req)
        first = self.prompt.block_key(req.start) if req.start < self.n else None
        return self.hop(branch, req, first)

    def head_hop(self, branch: bytes, start: int) -> bool:
        """Whether a hop asks the branch node of the fork head at level ``start`` (the prompt's block
        h_{start+1} is the branch key): that node holds the head, not the rest of level ``start``."""
        return start < self.n and self.prompt.hash_at(start) == branch

    def _absorb(self, url: str, a: ProbeAnswer, branch: bytes, start: int, stop: int | None) -> None:
        L = self.num_levels if stop is None else min(stop, self.num_levels)
        held_end = min(start + a.held, self.n, L)  # levels [start, held_end) hold their next block
        end = min(a.end, L - 1)  # the last level answered
        if held_end > start:
            run = self.held_at[start:held_end]
            if run.count(None) == len(run):
                self.held_at[start:held_end] = [url] * (held_end - start)
            else:
                self.held_at[start:held_end] = [u if u is not None else url for u in run]
        if end >= start:
            keep = {j: self.exact[j] for j in a.inexact if start <= j <= end}
            self.exact[start:end + 1] = b"\x01" * (end + 1 - start)
            for j, v in keep.items():
                self.exact[j] = v
            first = start + 1 if self.head_hop(branch, start) else start
            if end >= first:
                self.branch_of[first:end + 1] = [branch] * (end + 1 - first)
        stopped = a.stop is not None and start + a.held == end and held_end == start + a.held
        if a.stop is not None and stopped and a.stop.fork and end + 1 < len(self.branch_of) and end < self.n:
            self.branch_of[end + 1] = self.prompt.hash_at(end)  # the fork head's branch holds the next level
        ref = a.stop.child if a.stop is not None and stopped else None
        self.runs.append(Run(
            start=start, held=max(0, held_end - start), stopped=stopped, fork=stopped and a.stop is not None and a.stop.fork,
            child=Hit((ref, url), ref.usable_tokens, ref.tier == TIER_ELSEWHERE) if ref is not None else None,
            snapshots={j: Hit((s, url), s.usable_tokens) for j, s in a.snapshots.items() if start <= j <= end}))

    async def run(self) -> None:
        """Walk the branches from the prompt's first block (module docstring), then follow up."""
        if not self.num_levels:
            return
        branch = self.prompt.hash_at(0) if self.n else self.branch_of[0]
        assert branch is not None
        start = 0
        # Hops an earlier walk took at forks are sent at once, beside the first (the same question the
        # walk would ask after the first answer, so the same answer); one the walk does not reach is
        # left to the caller (``leftover``), whose leases it releases.
        for j in self.hints[:MAX_EARLY]:
            if 0 < j < self.n and self.probes < MAX_HOPS - 1:
                head = self.prompt.hash_at(j)
                self.probes += 1
                self.sent_early += 1
                self.early_levels.append(j)
                self.early[(head, j)] = asyncio.ensure_future(self._send(head, self.request(j)))
        tried: set[tuple[bytes, int]] = set()
        while self.probes < MAX_HOPS:
            tried.add((branch, start))
            # A hop that reaches a level whose own hop was sent early asks only up to that level: the
            # early hop asks the rest (a 32k-token prompt forking after its system prompt sends each
            # node its part, as one lookup sends one node the whole). Where the prompt does not fork
            # there after all, the next hop asks the rest of this branch.
            stop = None if (branch, start) in self.early else self.early_stop(start)
            got = await self._ask(branch, start, stop, hop=True)
            if not got:
                # No node of this branch answered. A fork head's branch: its home's answer stands (the
                # match ends at its level). The branch node of h_1: the root level's home still knows level 0.
                home = self.branch_of[start]
                if self.exact[start] or home is None or (home, start) in tried:
                    break
                branch = home
                continue
            last = max(got, key=lambda a: (a.end, a.stop is None or a.stop.fork))
            if stop is not None and last.stop is None and start + last.held >= stop:
                start = stop  # held up to where it asked, no fork there: the rest is on this branch too
                continue
            j = min(last.end, self.num_levels - 1)
            held = last.stop is None or last.stop.fork
            if last.stop is not None and last.stop.fork:
                head = self.prompt.hash_at(j)
                if (head, j) in tried:
                    break  # its branch node did not confirm it: the match ends at level j (the home's child)
                self.fork_levels.append(j)
                branch, start = head, j
                continue
            if held or self.exact[j]:
                break
            # Level j was answered by a node that is not its home and does not hold the next block: the
            # branch node of a fork head that has lost it, or a node holding copies of this branch.
            nxt = self.prompt.hash_at(j) if j < self.n else None
            if nxt is not None and (nxt, j) not in tried and not (j == start and self.head_hop(branch, start)):
                branch, start = nxt, j  # a copy: the next block may be a fork head on its own branch node
                continue
            home = self.branch_of[j]
            if home is None or (home, j) in tried:
                break
            branch, start = home, j
        await self._confirm_child()
        await self._snapshots()

    def early_stop(self, start: int) -> int | None:
        """Where a hop from level ``start`` stops asking: one past the nearest later level whose hop
        was sent early (that level is asked by both: its home's answer says whether it forks)."""
        later = [j for _, j in self.early if j > start]
        return min(later) + 1 if later else None

    def matched(self) -> int:
        """m: the first level no answer holds (protocol.match.matched)."""
        return matched(self.runs, self.n)

    def result(self) -> Match[Found]:
        """The merged answer of every run so far (protocol.match.merge): the single-node answer."""
        return merge(self.runs, block_tokens=self.prompt.block_tokens, num_blocks=self.n, has_state=self.has_state)

    async def _confirm_child(self) -> None:
        """A best child that is a fork record is read from its branch node: ask that node to confirm
        (and lease) it; if it cannot, the record is stale and the next best child stands."""
        for _ in range(2):
            m = self.matched()
            best = best_child(self.runs, m)
            if best is None or not best.elsewhere:
                return
            self.runs = [dataclasses.replace(r, child=None) if r.child is best else r for r in self.runs]
            head = best.entry[0].key[1:]
            await self._ask(head, m, m + 1)
            # the branch node's answer, if any, was absorbed: it names the child as held there

    async def _snapshots(self) -> None:
        """Levels no home answered may hold a snapshot that beats what was found (module docstring)."""
        if not self.has_state:
            return
        B = self.prompt.block_tokens
        asked: set[int] = set()
        while self.probes < MAX_HOPS:
            res = self.result()
            m, kv, best = res.matched, res.kv_tokens, res.state_tokens
            # The highest level j with best <= jB < kv that no home answered and whose home is known.
            lo = -(-best // B)
            hi = min(m, self.num_levels - 1, (kv - 1) // B if kv else -1)
            j = hi
            while j >= lo:
                j = self.exact.rfind(0, lo, j + 1)
                if j < 0 or (j not in asked and self.branch_of[j] is not None):
                    break
                j -= 1
            if j < lo or j < 0:
                return
            branch = self.branch_of[j]
            assert branch is not None
            asked.add(j)
            self.exact[j] = 1  # asked once, whatever the answer
            await self._ask(branch, j, j + 1)

    def leftover(self) -> list[asyncio.Future[list[tuple[str, ProbeAnswer]]]]:
        """Early hops the walk did not use (their answers are not part of the lookup)."""
        out = list(self.early.values())
        self.early.clear()
        return out

    def leases(self) -> list[tuple[str, bytes]]:
        return [(url, a.lease_id) for url, a in self.answered if a.lease_id is not None]


__all__ = ["MAX_EARLY", "MAX_HOPS", "Found", "Hop", "Walk"]
