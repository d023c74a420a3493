"""Typed results of client operations."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from prefixstore.protocol.errors import ItemStatus, Reason
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.wire import EntryRef, GetItem, ItemResult
from .prompt import Prompt


@dataclass(frozen=True, kw_only=True)
class LookupResult:
    """How much of a prompt the store can give back, and the keys to read it.

    ``ok`` is False when the store could not be asked (error, timeout): the
    result is then a miss, never an exception.
    """

    prompt: Prompt
    kv_tokens: int = 0
    state_tokens: int = 0
    checkpoint_hint: int = 0
    matched_blocks: int = 0
    child: EntryRef | None = None
    snapshot: EntryRef | None = None
    lease_id: bytes | None = None
    ok: bool = True

    @property
    def num_tokens(self) -> int:
        return self.prompt.num_tokens

    def kv_reads(self, upto: int, layer_start: int = 0, layer_end: int | None = None, head_start: int = 0,
                 head_end: int | None = None) -> list[tuple[GetItem, int, int]]:
        """Reads that cover KV [0, upto): (item, token_start, token_end) per entry, of layers
        [layer_start, layer_end) and KV heads [head_start, head_end) (an engine at
        tensor-parallel size t reads its own heads: protocol/namespace.py ``payload_runs``).

        The last one may be a stored child of which only a prefix is used: its
        payload holds ``child.num_tokens`` tokens, the first ``token_end -
        token_start`` of which are this prompt's."""
        if upto > self.kv_tokens:
            raise ValueError(f"upto={upto} exceeds the reusable kv_tokens={self.kv_tokens}")
        B = self.prompt.block_tokens

        def item(key: bytes) -> GetItem:
            return GetItem(key=key, layer_start=layer_start, layer_end=layer_end, head_start=head_start,
                           head_end=head_end)

        full = min(upto // B, self.matched_blocks)
        reads = [(item(self.prompt.block_key(j)), j * B, (j + 1) * B) for j in range(full)]
        if upto > full * B:
            if full < self.matched_blocks:  # upto ends inside a matched block: use its first tokens
                key = self.prompt.block_key(full)
            else:
                assert self.child is not None, "kv_tokens beyond the matched blocks implies a child"
                key = self.child.key
            reads.append((item(key), full * B, upto))
        return reads

    def state_read(self, head_start: int = 0, head_end: int | None = None) -> GetItem | None:
        """The snapshot at ``state_tokens``, or state heads [head_start, head_end) of it."""
        if self.snapshot is None:
            return None
        return GetItem(key=self.snapshot.key, head_start=head_start, head_end=head_end)


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    """What a save did, per item offered."""

    stored: int = 0
    already: int = 0
    rejected: int = 0
    dropped: int = 0  # store failure: nothing was saved for these
    stored_bytes: int = 0  # payload bytes of the items stored (OK)
    results: list[tuple[Kind, ItemResult]] = field(default_factory=list)


def lost(r: ItemResult) -> bool:
    """Whether an item's outcome means no store took it up: dropped, or an offer no store answered."""
    return r.status is ItemStatus.DROPPED or r.reason is Reason.UNAVAILABLE


def tally(final: Sequence[ItemResult], put: Sequence[tuple[Kind, ItemResult]],
          sizes: Sequence[int] = ()) -> SaveResult:
    """A save's outcome, counted the one way every client counts it: per item its last answer
    (``final``: the put's where it was put, the offer's otherwise) is stored (OK), already there
    (HAVE), dropped (:func:`lost`) or rejected (the rest); ``put`` lists the items whose payloads were
    sent, with their put results (SaveResult.results); ``sizes``: each item's payload bytes, where
    ``stored_bytes`` is wanted."""
    stored = sum(r.status is ItemStatus.OK for r in final)
    have = sum(r.status is ItemStatus.HAVE for r in final)
    dropped = sum(lost(r) for r in final)
    stored_bytes = sum(size for r, size in zip(final, sizes) if r.status is ItemStatus.OK)
    return SaveResult(stored=stored, already=have, rejected=len(final) - stored - have - dropped, dropped=dropped,
                      results=list(put), stored_bytes=stored_bytes)
