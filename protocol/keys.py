"""Entry kinds and the one fixed-width key that names an entry on disk and on the wire."""

from __future__ import annotations

import enum

from .hashing import HASH_BYTES, BlockHash


class Kind(enum.IntEnum):
    """What an entry holds (DESIGN §4)."""

    BLOCK = 1  # KV of B tokens, keyed by h_j
    TAIL = 2  # KV of n < B tokens after a block (or the root), keyed by p(t)
    STATE = 3  # recurrent + conv state at boundary t, keyed by p(t)

    @property
    def metric_kind(self) -> str:
        """Metrics split memory shapes: blocks and tails are both KV."""
        return "state" if self is Kind.STATE else "kv"


class Origin(enum.IntEnum):
    """Why an engine took a snapshot at its boundary (retention). Eviction learns
    which origins get reused on the live traffic: in multi-turn chat the
    generation end is replayed by the next turn and the prompt end rarely is;
    when the same prompt is sent twice, the reverse."""

    UNKNOWN = 0
    PROMPT_END = 1
    GENERATION_END = 2
    JUNCTION = 3
    PERIODIC = 4


ENTRY_KEY_BYTES = 1 + HASH_BYTES


def make_entry_key(kind: Kind, h: BlockHash) -> bytes:
    """kind byte + 16-byte hash. A block h_j and a snapshot at t = jB share a
    hash; the kind byte keeps them apart."""
    if len(h) != HASH_BYTES:
        raise ValueError(f"hash: expected {HASH_BYTES} bytes, got {len(h)}")
    return bytes((kind,)) + h


def split_entry_key(key: bytes) -> tuple[Kind, BlockHash]:
    if len(key) != ENTRY_KEY_BYTES:
        raise ValueError(f"entry key: expected {ENTRY_KEY_BYTES} bytes, got {len(key)}")
    return Kind(key[0]), BlockHash(key[1:])
