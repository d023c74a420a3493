"""Where an entry lives in a cluster: rendezvous (highest-random-weight) hashing.

One function, used by clients and nodes alike, so every party that sees the
same member list computes the same owner for every key, with no coordination.

Members are named by their URL (``http://pod-0.svc.ns.svc.cluster.local:8077``,
no trailing slash). The score of a member for a key is the xxh3-64 of the
member's name and the key; the members ordered by falling score are the key's
**rendezvous order**: the first is its owner, the next ones take its replicas
(hot-prefix replication). Removing a member moves only the keys it owned;
adding one moves to it only the keys it now wins (about 1/N of them).

Placement key (the *level key*). An entry is placed by the hash it is
registered under in the index (its parent; a snapshot: its container's
parent) **and its first token**, so that one node can answer everything a
lookup needs to know about one level of a prompt::

    level j of a prompt (j = 0..n, n full blocks):  key (h_j, t_jB)   (h_0 = the namespace root)

      owner(h_j, t) holds  - every block and tail whose parent is h_j and whose
                             first token is t (the prompt's next block h_{j+1},
                             other conversations' blocks diverging there, tails)
                           - every snapshot whose container is one of those

    so a fan-out asks owner(h_j, t_jB) "is h_{j+1} stored; which child of h_j
    agrees longest with my tokens [jB, (j+1)B); which snapshot under h_j is the
    best" and merges the levels exactly as a single node would walk them.

The first token costs no exactness: a child that agrees with the prompt for
even one token starts with the prompt's token, and a snapshot counts only if
its container agrees with the prompt up to its boundary. It spreads the
children of a hot parent (every conversation under one system prompt) over
the cluster instead of piling them on the parent's owner.

A block therefore lives with its siblings, not with its parent: a chain of
blocks is spread over the cluster level by level. Tails and snapshots live
with the blocks of the same level.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

from .hashing import TOKEN_BYTES


def normalize_url(url: str) -> str:
    """A member's identity: its URL without surrounding blanks or a trailing slash."""
    return url.strip().rstrip("/")


def score(member: str, key: bytes) -> int:
    """The rendezvous weight of ``member`` for ``key`` (xxh3-64 of both, length-prefixed so that
    ("ab", "c") and ("a", "bc") never collide)."""
    name = member.encode()
    return xxhash.xxh3_64_intdigest(len(name).to_bytes(2, "little") + name + key)


def rank(members: Iterable[str], key: bytes) -> list[str]:
    """``members`` in rendezvous order for ``key``: owner first. Ties (never in practice) by name."""
    return sorted(members, key=lambda m: (-score(m, key), m))


def owner(members: Sequence[str], key: bytes) -> str:
    """The first member in rendezvous order; ``members`` must not be empty."""
    if not members:
        raise ValueError("members: placement needs at least one member")
    return max(members, key=lambda m: (score(m, key), _reverse(m)))


def _reverse(m: str) -> tuple[int, ...]:
    # max() with the same tie-break as rank(): the smaller name wins a tie.
    return tuple(-ord(c) for c in m)


def level_key(parent: bytes, tokens: bytes) -> bytes:
    """The placement key of a level: its parent hash h_j and the first token (packed uint32) of the
    tokens that follow it. For a block or tail: its parent and its own tokens; for a snapshot: those of
    its container."""
    return bytes(parent) + bytes(tokens[:TOKEN_BYTES])


__all__ = ["level_key", "normalize_url", "owner", "rank", "score"]
