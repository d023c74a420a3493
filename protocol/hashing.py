"""The block hash chain and the prefix hash at any token position (DESIGN §3).

::

    h_0 = xxh3_128(namespace_id)
    h_j = xxh3_128(h_{j-1} || tokens[(j-1)B : jB] as little-endian uint32 || extra_j)
    p(t) = h_{t/B}                                   if B divides t
         = xxh3_128(h~ || tokens[(t//B)B : t])       otherwise, where
      h~ = h_{t//B}, or xxh3_128(h_{t//B} || extra) when block t//B+1 carries an extra

Only full blocks are chained. Tails (partial blocks) and snapshots are keyed
by p(t). ``extra_j`` carries per-block extra keys (LoRA id, hashes of
multimodal items overlapping block j); a tail inside block j+1 takes that
block's extra, so a LoRA or image change is never hidden by a tail. (See
:func:`tail_hash` for why the extra is folded into the chaining value there.)

Hashing runs on every request's critical path. The chain is one native loop
(``protocol/_chain.c``, xxHash's own header): 8,192 blocks (131,072 tokens
at B=16) in about 0.4 ms, against 2.5-4.5 ms for the pure-Python loop that
remains as the fallback and the reference (``chain_from_python``).
"""

from __future__ import annotations

import array
import sys
from collections.abc import Sequence
from typing import Final, NewType, cast

import numpy as np
import xxhash

from .namespace import Namespace

BlockHash = NewType("BlockHash", bytes)
"""A 16-byte xxh3-128 digest naming a block, a tail or a snapshot boundary."""

HASH_BYTES = 16
TOKEN_BYTES = 4

_digest = xxhash.xxh3_128_digest

try:  # the optional native loop (protocol/_chain.c); same bytes, ~10x faster
    from ._chain import chain as _native_chain
except ImportError:  # pragma: no cover - built wherever a C compiler is available
    _native_chain = None
NATIVE = _native_chain is not None
"""Whether the native hash chain (protocol/_chain.c) is in use (``prefixstore stats``)."""

_BIG_ENDIAN = sys.byteorder == "big"
assert array.array("I").itemsize == TOKEN_BYTES, "array('I') must be 32-bit on this platform"


def pack_tokens(tokens: Sequence[int] | np.ndarray | bytes) -> bytes:
    """Token ids as little-endian uint32 bytes (the only form that is hashed)."""
    if isinstance(tokens, bytes):
        if len(tokens) % TOKEN_BYTES:
            raise ValueError("packed tokens: length is not a multiple of 4")
        return tokens
    if isinstance(tokens, (list, tuple)):
        # array('I') packs a list of ints 3-4x faster than numpy and range-checks
        # each id (OverflowError/TypeError for negatives, > 2**32-1, non-ints).
        try:
            packed = array.array("I", tokens)
        except (OverflowError, TypeError) as err:
            raise ValueError(f"tokens: token ids must be integers in [0, 2**32): {err}") from None
        if _BIG_ENDIAN:
            packed.byteswap()
        return packed.tobytes()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError("tokens: expected a 1-D sequence of token ids")
    if arr.size and not _in_token_range(arr):
        raise ValueError("tokens: token ids must be integers in [0, 2**32)")
    return arr.astype("<u4", copy=False).tobytes()


def _in_token_range(arr: np.ndarray) -> bool:
    """Whether every id of an integer array fits uint32, reading the array only where its dtype
    does not already say so: an unsigned dtype of at most 4 bytes always fits, a signed one of at
    most 4 bytes needs only its minimum. A 131,072-token uint32 prompt was read three times (min,
    max, the copy): 0.18-0.23 ms of a lookup after an idle pause here, against 0.09-0.11 ms for
    the copy alone (docs/benchmarks.md, issue 33)."""
    kind, size = arr.dtype.kind, arr.dtype.itemsize
    if kind == "u" and size <= TOKEN_BYTES:
        return True
    if kind == "i" and size <= TOKEN_BYTES:
        return int(arr.min()) >= 0
    return kind in "iu" and int(arr.min()) >= 0 and int(arr.max()) <= 0xFFFFFFFF


def unpack_tokens(packed: bytes) -> np.ndarray:
    return np.frombuffer(packed, dtype="<u4")


def root_hash(namespace: Namespace | bytes) -> BlockHash:
    """h_0: the chain's root, derived from the namespace id (or the id itself)."""
    ns_id = namespace if isinstance(namespace, bytes) else namespace.id
    return BlockHash(_digest(ns_id))


def chain_hash(parent: BlockHash, packed_tokens: bytes, extra: bytes = b"") -> BlockHash:
    """One link of the chain: the hash of a full block following ``parent``.

    A full block's token bytes have a fixed length (4B), so ``extra``
    appended after them is unambiguous."""
    return BlockHash(_digest(parent + packed_tokens + extra))


def tail_hash(parent: BlockHash, packed_tokens: bytes, extra: bytes = b"") -> BlockHash:
    """p(t) for t inside a block: the key of a tail or a mid-block snapshot.

    Tail tokens have variable length, so appending ``extra`` after them would
    be ambiguous (tail [5] with extra LE32(1) == tail [5, 1]). An extra is
    folded into the chaining value instead: xxh3_128(xxh3_128(h || extra) ||
    tokens). With no extra this is DESIGN §3's formula unchanged."""
    base = _digest(parent + extra) if extra else parent
    return BlockHash(_digest(base + packed_tokens))


def block_hashes(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray | bytes,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """h_1 .. h_n for the n full blocks of ``tokens``."""
    packed = pack_tokens(tokens)
    return chain_from(root_hash(namespace), packed, namespace.block_tokens, extra_keys)


def chain_from(
    parent: BlockHash,
    packed: bytes,
    block_tokens: int,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """h_1..h_n following ``parent`` for the full blocks of ``packed`` tokens."""
    stride = block_tokens * TOKEN_BYTES
    if _native_chain is not None:
        return cast(list[BlockHash], _native_chain(parent, packed, stride, list(extra_keys) if extra_keys else None))
    return chain_from_python(parent, packed, block_tokens, extra_keys)


def chain_bytes(
    parent: BlockHash,
    packed: bytes,
    block_tokens: int,
    extra_keys: Sequence[bytes] | None = None,
) -> bytes:
    """h_1 || h_2 || ... || h_n as one bytes (16 each): the chain as a lookup or probe sends it,
    without a bytes object per block (protocol/_chain.c)."""
    if _native_chain is not None:
        return cast(bytes, _native_chain(parent, packed, block_tokens * TOKEN_BYTES,
                                         list(extra_keys) if extra_keys else None, True))
    return b"".join(chain_from_python(parent, packed, block_tokens, extra_keys))


def pack_and_chain(
    parent: BlockHash,
    tokens: Sequence[int] | np.ndarray | bytes,
    block_tokens: int,
    extra_keys: Sequence[bytes] | None = None,
) -> tuple[bytes, bytes]:
    """``(pack_tokens(tokens), chain_bytes(parent, that, ...))``. A 1-D little-endian uint32 array
    (what a tokenizer's ids usually are in numpy) is copied while it is hashed, in one native pass
    over it: it needs no range check, and the separate copy cost a 131,072-token lookup 0.09-0.11
    ms after an idle pause here (docs/benchmarks.md, issue 33)."""
    if (_native_chain is not None and isinstance(tokens, np.ndarray) and tokens.ndim == 1
            and tokens.dtype == _LE_U32 and tokens.flags.c_contiguous):
        packed, hashes = _native_chain(parent, tokens, block_tokens * TOKEN_BYTES,
                                       list(extra_keys) if extra_keys else None, True, True)
        return cast(bytes, packed), cast(bytes, hashes)
    packed = pack_tokens(tokens)
    return packed, chain_bytes(parent, packed, block_tokens, extra_keys)


_LE_U32: Final = np.dtype("<u4")


def chain_from_python(
    parent: BlockHash,
    packed: bytes,
    block_tokens: int,
    extra_keys: Sequence[bytes] | None = None,
) -> list[BlockHash]:
    """The chain in pure Python: the fallback where the native module is not built, and its reference."""
    stride = block_tokens * TOKEN_BYTES
    num_blocks = len(packed) // stride
    chunks = [packed[s : s + stride] for s in range(0, num_blocks * stride, stride)]
    out: list[bytes] = []
    append = out.append
    h: bytes = parent
    # The hot loop: one concatenation and one digest per block, no wrapper
    # calls (NewType is a function call at run time; the cast below is free).
    if extra_keys:
        for j, chunk in enumerate(chunks):
            h = _digest(h + chunk + (extra_keys[j] if j < len(extra_keys) else b""))
            append(h)
    else:
        for chunk in chunks:
            h = _digest(h + chunk)
            append(h)
    return cast(list[BlockHash], out)


def prefix_hash(
    namespace: Namespace,
    tokens: Sequence[int] | np.ndarray | bytes,
    t: int,
    hashes: Sequence[BlockHash] | None = None,
    extra_keys: Sequence[bytes] | None = None,
) -> BlockHash:
    """p(t): the key of a tail or snapshot ending at token t (1 <= t <= len)."""
    packed = pack_tokens(tokens)
    if not 0 < t <= len(packed) // TOKEN_BYTES:
        raise ValueError(f"t: must be in [1, {len(packed) // TOKEN_BYTES}], got {t}")
    B = namespace.block_tokens
    j = t // B
    if hashes is None:
        hashes = block_hashes(namespace, packed[: j * B * TOKEN_BYTES], extra_keys)
    parent = root_hash(namespace) if j == 0 else hashes[j - 1]
    if t % B == 0:
        return parent
    extra = extra_keys[j] if extra_keys and j < len(extra_keys) else b""
    return tail_hash(parent, packed[j * B * TOKEN_BYTES : t * TOKEN_BYTES], extra)
