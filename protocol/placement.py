"""Where an entry lives in a cluster: branches of the prefix tree, placed by rendezvous hashing.

One function (:func:`rank`), used by clients and nodes alike, so every party that sees the same
member list computes the same owner for every key, with no coordination. Members are named by
their URL (``http://pod-0.svc.ns.svc.cluster.local:8077``, no trailing slash). The score of a
member for a key is the xxh3-64 of the member's name and the key; the members ordered by
falling score are the key's **rendezvous order**: the first is its owner, the next ones hold its
copies (the ``replicas`` setting, hot-prefix replication). Removing a member moves only the keys
it owned; adding one moves to it only the keys it now wins (about 1/N of them).

**What is placed: branches, not levels** (DESIGN §8). A *level* of a namespace is one parent
hash h with everything registered under it: its children (blocks and tails) and the snapshots
whose container is one of them. Every level has one **home**, the node that holds all of it, so
the home answers that level exactly as a single node would (store/lookups.py). Homes::

    the root level (children of h_0)      rank(members, level_key(h_0, t_0))[0]   per first token
    the children of a block c             c's own node        if c is a continuation
                                          rank(members, c)[0] if c is a fork head

A block is a **continuation** when, at its level's home, it is the first block child of its
parent: the next turn of a conversation extends its leaf and stays on its node. Any later block
child of the same parent is a **fork head** (a new conversation under a shared system prompt, a
regenerated answer), and so is every block under the root. A fork head is kept twice:

* as a **record** at its level's home: its tokens and extra keys, no payload (``ItemSpec.record``),
  so the home still sees every child of the level (partial matches stay exact) and every snapshot
  registered in it (a snapshot at the end of a shared system prompt is found by every conversation);
* in full on its **branch node** rank(c)[0], as the first block of its branch: its children,
  their continuations and everything registered under them live there.

So a conversation stays together (one node answers all of it) and conversations spread over the
cluster (each fork head hashes to its own node). The **branch key** of an entry is the key whose
rendezvous order placed it: ``level_key(h_0, t_0)`` for the root level, else the hash of the fork
head its branch starts with. Copies go to the next members in that order, so the copies of a
branch stay together too.

A lookup walks the prompt's branches (protocol/probe.py): it asks the branch node of the prompt's
first block, which answers every level it is the home of and names the fork head where the
prompt continues elsewhere; hops = forks along the prompt, not N.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import xxhash

from .hashing import HASH_BYTES, TOKEN_BYTES

BRANCH_KEY_SIZES = (HASH_BYTES, HASH_BYTES + TOKEN_BYTES)
"""A branch key is a fork head's hash (16 bytes) or the root level's key (root hash and first token)."""


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
    """A parent hash and the first token (packed uint32) of the tokens that follow it: the branch
    key of the root level (``level_key(h_0, prompt tokens)``), split by first token so that
    namespaces whose entries carry no common first token (keys turned into tokens by the SGLang
    and LMCache adapters) spread their first blocks' records over the cluster."""
    return bytes(parent) + bytes(tokens[:TOKEN_BYTES])


def root_branch(root: bytes, tokens: bytes) -> bytes:
    """The branch key of the root level for a prompt starting with ``tokens`` (packed)."""
    return level_key(root, tokens)


__all__ = ["BRANCH_KEY_SIZES", "level_key", "normalize_url", "owner", "rank", "root_branch", "score"]
