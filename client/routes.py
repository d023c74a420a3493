"""What a cluster client learns of where things are, bounded: read routes, save placement, fork hints.

Three memories, each written where the client learns it and read where it acts on it:

* :class:`ReadRoutes` -- which node answered for each entry a lookup named (reads go there, or to
  a node holding a hot copy of it), and the copies recent answers named;
* :class:`Placement` -- for saves: the branch key of the level under each block seen (the level's
  home), each entry's parent hash (a snapshot's level is its container's), and where each item
  was offered (its put goes to the same node);
* :class:`ForkHints` -- where walks from a prompt's first block followed a fork, so the next walk
  sends that hop at once (client/walk.py ``Walk.hints``).

Each is a :class:`~prefixstore.client.lru.BoundedLRU` (or a few): the oldest writes are forgotten
first, so a client that sees endless traffic holds a bounded amount of it. Forgetting costs at
most a walk (a save whose level is unknown walks first) or a read that is a miss.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence

from prefixstore.protocol.keys import Kind
from prefixstore.protocol.placement import root_branch
from prefixstore.protocol.wire import ItemSpec

from .lru import BoundedLRU
from .prompt import Prompt

MAX_KNOWN_KEYS = 1 << 18
"""Entry keys (or blocks) each memory of this module keeps; oldest forgotten first."""
MAX_FORK_HINTS = 1 << 14
"""Prompts' first blocks whose walks' fork levels the client remembers, and fork heads it remembers
(Walk.hints), each."""
MAX_FORK_LEVELS = 4
"""Fork levels remembered per first block (the most recent distinct ones)."""
MAX_UNROUTED = 64
"""Lookups whose block routes wait for a read to be written into the client's route map. A lookup
of the same matched run again replaces its record (an engine's scheduler asks again for a waiting
request every step), so only distinct prompts count against it."""
REPLICA_TTL_S = 5.0
"""How long a replica set learned from an answer is used to spread probes and reads."""

Routes = tuple[bytes, Sequence[bytes], Sequence[str]]
"""(prefix, keys, nodes): entry ``prefix + keys[i]`` was answered by ``nodes[i]``."""


class ReadRoutes:
    """Where each entry a lookup named can be read (module docstring).

    A lookup's matched run (2,048 blocks of a 32k-token prompt) is queued as one record and written
    into the route map only when a read needs it: writing it at once was a third of a cluster
    lookup's client time. Queued records are keyed by what they route -- (True, the run's last
    block key) for a matched run (the hash chain makes it name the whole run), (False, entry key)
    for one entry -- so the same run learned again replaces its record and becomes the newest."""

    def __init__(self) -> None:
        self._where: BoundedLRU[bytes, str] = BoundedLRU(MAX_KNOWN_KEYS)  # entry key -> node that answered
        self._unrouted: BoundedLRU[tuple[bool, bytes], Routes] = BoundedLRU(MAX_UNROUTED, self._write)
        self._replicas: BoundedLRU[bytes, tuple[float, tuple[str, ...]]] = BoundedLRU(MAX_KNOWN_KEYS)

    def _write(self, _: tuple[bool, bytes], routes: Routes) -> None:
        prefix, keys, nodes = routes
        self._where.put_many(zip(map(prefix.__add__, keys), nodes))

    def run(self, prefix: bytes, keys: Sequence[bytes], nodes: Sequence[str]) -> None:
        """A lookup's matched blocks and the nodes that held them, queued (class docstring)."""
        self._unrouted.put((True, prefix + keys[-1]), (prefix, keys, nodes))

    def remember(self, key: bytes, node: str) -> None:
        """One entry (a child, a snapshot) and the node that reported it: after the routes learned
        before it, never overwritten by them."""
        if len(self._unrouted):
            self._unrouted.put((False, key), (b"", (key,), (node,)))
        else:
            self._where.put(key, node)

    def holder(self, key: bytes) -> str | None:
        """The node that answered for ``key`` (None: no lookup of this client named it)."""
        self.flush()
        return self._where.get(key)

    def flush(self) -> None:
        """Write every queued route into the route map, oldest first."""
        while len(self._unrouted):
            self._write(*self._unrouted.pop_oldest())

    def learn_replicas(self, url: str, replicas: Mapping[bytes, tuple[str, ...]], now: float) -> None:
        """An answer of ``url`` named nodes holding copies of some of its entries (hot prefixes)."""
        for key, nodes in replicas.items():
            self._replicas.put(key, (now + REPLICA_TTL_S, tuple(u for u in nodes if u != url) + (url,)))

    def replicas_of(self, key: bytes, now: float | None = None) -> tuple[str, ...]:
        """The nodes holding replicas of an entry, as learned from recent answers (hot prefixes)."""
        now = time.monotonic() if now is None else now
        known = self._replicas.get(key)
        if known is None:
            return ()
        if known[0] < now:
            self._replicas.pop(key)
            return ()
        return known[1]


class Placement:
    """Where the levels this client saw live, for its saves (module docstring)."""

    def __init__(self, namespace_root: bytes) -> None:
        self.namespace_root = namespace_root
        self._homes: BoundedLRU[bytes, bytes] = BoundedLRU(MAX_KNOWN_KEYS)  # block -> branch of the level under it
        self._parents: BoundedLRU[bytes, bytes] = BoundedLRU(MAX_KNOWN_KEYS)  # entry key -> parent hash
        self._offered: BoundedLRU[bytes, tuple[str, ItemSpec]] = BoundedLRU(MAX_KNOWN_KEYS)  # entry key -> offer

    def learned(self, parent: bytes, branch: bytes) -> None:
        """The level under block ``parent`` is homed on ``branch`` (learned from walks and saves)."""
        self._homes.put(bytes(parent), branch)

    def parent_of(self, key: bytes, parent: bytes) -> None:
        """Entry ``key`` hangs from block ``parent`` (a snapshot: its container does)."""
        self._parents.put(key, bytes(parent))

    def branch_of(self, parent: bytes, tokens: bytes = b"") -> bytes | None:
        """The branch key of the level under ``parent`` (the root level: by the first token), as
        learned; None when this client has not seen it."""
        if parent == self.namespace_root:
            return root_branch(parent, tokens)
        return self._homes.get(bytes(parent))

    def level_parent(self, spec: ItemSpec, batch: Mapping[bytes, bytes]) -> bytes | None:
        """The parent hash of the level an item registers under (a snapshot: its container's parent),
        from ``batch`` (entry key -> parent hash of the items offered with it) or as learned."""
        if spec.kind is Kind.STATE:
            key = spec.container or b""
            return batch.get(key) or self._parents.get(key)
        return spec.parent

    def offered(self, key: bytes, url: str, spec: ItemSpec) -> None:
        """Item ``key`` was offered to ``url`` as ``spec`` (its branch named): its put goes there."""
        self._offered.put(key, (url, spec))

    def take_offer(self, key: bytes) -> tuple[str, ItemSpec] | None:
        """Where item ``key`` was offered, forgotten once asked (one put per offer)."""
        return self._offered.pop(key)


class ForkHints:
    """Where walks forked (Walk.hints): h_1 -> levels where walks from it followed a fork, and the
    blocks they found there as fork heads. A level is a hint for a prompt only where the prompt's own
    block there is a known head: the conversation that continues on the system prompt's branch shares
    h_1 and the level with those that fork, not the block."""

    def __init__(self) -> None:
        self._levels: BoundedLRU[bytes, tuple[int, ...]] = BoundedLRU(MAX_FORK_HINTS)
        self._heads: BoundedLRU[bytes, None] = BoundedLRU(MAX_FORK_HINTS)

    def levels(self, p: Prompt) -> tuple[int, ...]:
        """The levels walks from this prompt's first block forked at (most recent first)."""
        return self._levels.get(p.hash_at(0), ()) if p.num_blocks else ()

    def hints(self, p: Prompt, levels: Iterable[int]) -> tuple[int, ...]:
        """Of ``levels``, those where this prompt's own block is a known fork head."""
        n = p.num_blocks
        return tuple(j for j in levels if j < n and p.hash_at(j) in self._heads)

    def learn(self, p: Prompt, levels: Sequence[int], early: Sequence[int], followed: Sequence[int]) -> None:
        """A walk from ``p`` (hinted ``levels``) sent hops early at ``early`` and followed forks at
        ``followed``: remember those, and forget a head it was hinted and did not follow (the store
        no longer forks there)."""
        for j in early:
            if j not in followed:
                self._heads.pop(p.hash_at(j))
        if not followed:
            return
        for j in followed:
            self._heads.put(p.hash_at(j), None)
        self._levels.put(p.hash_at(0), tuple(dict.fromkeys([*followed, *levels]))[:MAX_FORK_LEVELS])


__all__ = ["MAX_FORK_HINTS", "MAX_FORK_LEVELS", "MAX_KNOWN_KEYS", "MAX_UNROUTED", "REPLICA_TTL_S", "ForkHints",
           "Placement", "ReadRoutes"]
