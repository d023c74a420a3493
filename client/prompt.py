"""A prompt as the store sees it: packed tokens and the block hash chain, computed once.

Builds the items an engine offers and puts (blocks, tails, snapshots) with
the right parents, containers and keys, so engine code never assembles keys
by hand.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence
from typing import cast, overload

import numpy as np
import xxhash

from prefixstore.protocol import checksums
from prefixstore.protocol.hashing import HASH_BYTES, TOKEN_BYTES, BlockHash, pack_and_chain, root_hash, tail_hash
from prefixstore.protocol.keys import Kind, make_entry_key
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import ItemSpec


class HashRun(Sequence[BlockHash]):
    """h_1 .. h_m of a prompt as a sequence over its ``hash_bytes``, each sliced when read: a cluster
    lookup queues the matched run for its read routes (client/routes.py), which reads it only if a
    read needs it, and making 8,192 bytes objects per lookup of a 131,072-token prompt cost more
    than the rest of the client's share of it."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __len__(self) -> int:
        return len(self._data) // HASH_BYTES

    @overload
    def __getitem__(self, i: int) -> BlockHash: ...

    @overload
    def __getitem__(self, i: slice) -> list[BlockHash]: ...

    def __getitem__(self, i: int | slice) -> BlockHash | list[BlockHash]:
        n = len(self)
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(n))]
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(i)
        return BlockHash(self._data[i * HASH_BYTES : (i + 1) * HASH_BYTES])

    def __iter__(self) -> Iterator[BlockHash]:
        data = self._data
        return (BlockHash(data[i : i + HASH_BYTES]) for i in range(0, len(data), HASH_BYTES))


class Prompt:
    def __init__(self, namespace: Namespace, tokens: Sequence[int] | np.ndarray | bytes,
                 extra_keys: Sequence[bytes] | None = None) -> None:
        self.namespace = namespace
        self.extra_keys = list(extra_keys or ())
        self.root = root_hash(namespace)
        # The chain as a lookup sends it (16 bytes a block, back to back); the list of per-block
        # hashes only when something asks for it (saves, cluster walks): for a lookup of a
        # 131,072-token prompt the 8,192 bytes objects cost more than the hashing itself.
        self.packed, self.hash_bytes = pack_and_chain(self.root, tokens, namespace.block_tokens, self.extra_keys)
        self._hashes: list[BlockHash] | None = None

    @property
    def hashes(self) -> list[BlockHash]:
        """h_1..h_n, one per full block (``hash_bytes`` split)."""
        if self._hashes is None:
            hb = self.hash_bytes
            self._hashes = cast(list[BlockHash], [hb[i : i + HASH_BYTES] for i in range(0, len(hb), HASH_BYTES)])
        return self._hashes

    @property
    def num_blocks(self) -> int:
        """n: full blocks of the prompt (``len(hashes)``, without making the list)."""
        return len(self.hash_bytes) // HASH_BYTES

    def hash_at(self, j: int) -> BlockHash:
        """h_{j+1}: the hash of 0-based block j (``hashes[j]``, sliced from ``hash_bytes``: a walk of a
        131,072-token prompt reads a few of them, and making the list of 8,192 cost it a millisecond)."""
        if not 0 <= j < self.num_blocks:
            raise IndexError(f"block {j} of {self.num_blocks}")
        return BlockHash(self.hash_bytes[j * HASH_BYTES : (j + 1) * HASH_BYTES])

    def hash_run(self, m: int) -> HashRun:
        """h_1 .. h_m as a lazy sequence (:class:`HashRun`)."""
        if not 0 <= m <= self.num_blocks:
            raise IndexError(f"{m} blocks of {self.num_blocks}")
        return HashRun(self.hash_bytes[: m * HASH_BYTES])

    @property
    def num_tokens(self) -> int:
        return len(self.packed) // TOKEN_BYTES

    @property
    def block_tokens(self) -> int:
        return self.namespace.block_tokens

    def _extra(self, j: int) -> bytes:
        return self.extra_keys[j] if j < len(self.extra_keys) else b""

    def parent_of_block(self, j: int) -> BlockHash:
        """Parent hash of 0-based block j (h_j in DESIGN's 1-based notation)."""
        return self.root if j == 0 else self.hash_at(j - 1)

    def tokens(self, start: int, end: int) -> bytes:
        return self.packed[start * TOKEN_BYTES : end * TOKEN_BYTES]

    def prefix_hash(self, t: int) -> BlockHash:
        """p(t)."""
        B = self.block_tokens
        j = t // B
        if t % B == 0:
            return self.parent_of_block(j)
        return tail_hash(self.parent_of_block(j), self.tokens(j * B, t), self._extra(j))

    # ------------------------------------------------------------ keys

    def block_key(self, j: int) -> bytes:
        return make_entry_key(Kind.BLOCK, self.hash_at(j))

    def kv_key_ending_at(self, t: int) -> bytes:
        """Key of the block (t on a block boundary) or tail that ends at token t."""
        B = self.block_tokens
        if t % B == 0:
            return self.block_key(t // B - 1)
        return make_entry_key(Kind.TAIL, self.prefix_hash(t))

    def container_key(self, t: int, kv_upto: int) -> bytes:
        """The entry a snapshot at t registers in, given KV stored for [0, kv_upto).

        The full block whose range (start, end] holds t if that block is
        stored, else the tail ending at kv_upto (which then lies in t's block)."""
        B = self.block_tokens
        if not 0 < t <= kv_upto:
            raise ValueError(f"snapshot boundary {t} needs KV of [0, {t}); only [0, {kv_upto}) is stored")
        block_end = -(-t // B) * B
        if block_end <= kv_upto:
            return self.block_key(block_end // B - 1)
        return self.kv_key_ending_at(kv_upto)

    # ------------------------------------------------------------ items

    def kv_items(self, kv_upto: int, start: int = 0) -> list[tuple[ItemSpec, int, int]]:
        """Items (without payload facts) covering KV [start, kv_upto): full blocks, then a tail.

        Returns (spec, token_start, token_end); ``start`` must be block-aligned."""
        B = self.block_tokens
        if start % B:
            raise ValueError(f"start {start} is not a multiple of the block size {B}")
        kv_upto = min(kv_upto, self.num_tokens)
        token_bytes = self.namespace.kv.token_bytes
        out: list[tuple[ItemSpec, int, int]] = []
        for j in range(start // B, kv_upto // B):
            s = j * B
            out.append((ItemSpec(kind=Kind.BLOCK, hash=self.hashes[j], size=B * token_bytes,
                                 parent=self.parent_of_block(j), tokens=self.tokens(s, s + B),
                                 extra=self._extra(j)), s, s + B))
        if kv_upto % B and kv_upto > start:
            s = kv_upto // B * B
            out.append((ItemSpec(kind=Kind.TAIL, hash=self.prefix_hash(kv_upto), size=(kv_upto - s) * token_bytes,
                                 parent=self.parent_of_block(s // B), tokens=self.tokens(s, kv_upto),
                                 extra=self._extra(s // B)), s, kv_upto))
        return out

    def state_item(self, t: int, kv_upto: int, origin: int = 0) -> ItemSpec:
        """A snapshot at boundary t; ``origin`` (protocol.keys.Origin) says why it was taken."""
        return ItemSpec(kind=Kind.STATE, hash=self.prefix_hash(t), size=self.namespace.state.snapshot_bytes,
                        container=self.container_key(t, kv_upto), boundary=t, origin=origin)


OFF_LOOP_BYTES = 1 << 20
"""A put batch of more payload bytes than this is checksummed in a worker thread (the native loop
releases the GIL: the event loop keeps serving meanwhile); smaller ones inline, where a thread
hop (~0.1 ms) would cost more than the hashing."""


async def with_payloads(specs: Sequence[ItemSpec], views: Sequence[memoryview]) -> list[ItemSpec]:
    """Every spec with its size and checksum taken from its payload (``views``: byte views), the
    batch hashed off the event loop when it is large (:data:`OFF_LOOP_BYTES`)."""
    vs = list(views)
    total = sum(v.nbytes for v in vs)
    sums = await asyncio.to_thread(checksums.digests, vs) if total > OFF_LOOP_BYTES else checksums.digests(vs)
    return [dataclasses.replace(spec, size=v.nbytes, checksum=c) for spec, v, c in zip(specs, vs, sums)]


def with_payload(spec: ItemSpec, payload: bytes | memoryview | bytearray) -> ItemSpec:
    """The spec with its size and checksum taken from the payload it will carry."""
    view = memoryview(payload).cast("B")
    return dataclasses.replace(spec, size=len(view), checksum=xxhash.xxh3_64_intdigest(view))
