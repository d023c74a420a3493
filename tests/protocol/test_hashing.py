"""The block hash chain and prefix hash (DESIGN §3), recomputed independently with xxhash."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from prefixstore.protocol import (
    HASH_BYTES,
    BlockHash,
    Kind,
    block_hashes,
    chain_from,
    chain_hash,
    make_entry_key,
    pack_tokens,
    prefix_hash,
    root_hash,
    split_entry_key,
    unpack_tokens,
)

from ..factories import make_namespace

B = 4
NS = make_namespace(block_tokens=B)


# ---------------------------------------------------------------- an independent reference


def le_u32(tokens: list[int]) -> bytes:
    return b"".join(struct.pack("<I", t) for t in tokens)


def ref_chain(ns_id: bytes, tokens: list[int], block: int, extras: list[bytes] | None = None) -> list[bytes]:
    """[h_0, h_1, ..., h_n] straight from DESIGN §3."""
    extras = extras or []
    h = [xxhash.xxh3_128_digest(ns_id)]
    for j in range(1, len(tokens) // block + 1):
        extra = extras[j - 1] if j - 1 < len(extras) else b""
        h.append(xxhash.xxh3_128_digest(h[j - 1] + le_u32(tokens[(j - 1) * block : j * block]) + extra))
    return h


def ref_prefix(ns_id: bytes, tokens: list[int], block: int, t: int) -> bytes:
    h = ref_chain(ns_id, tokens, block)
    if t % block == 0:
        return h[t // block]
    j = t // block
    return xxhash.xxh3_128_digest(h[j] + le_u32(tokens[j * block : t]))


TOKENS = [7, 0, 2**32 - 1, 123456, 42, 42, 42, 9, 65535, 65536, 1, 2, 3]  # 3 full blocks + 1 token


# ---------------------------------------------------------------- the chain


def test_root_is_xxh3_128_of_namespace_id() -> None:
    assert root_hash(NS) == xxhash.xxh3_128_digest(NS.id)
    assert root_hash(NS.id) == root_hash(NS)
    assert len(root_hash(NS)) == HASH_BYTES


def test_chain_matches_design() -> None:
    ref = ref_chain(NS.id, TOKENS, B)
    got = block_hashes(NS, TOKENS)
    assert len(got) == len(TOKENS) // B == 3  # only full blocks are chained
    assert got == ref[1:]
    assert all(isinstance(h, bytes) and len(h) == HASH_BYTES for h in got)


@pytest.mark.parametrize("form", ["list", "int64", "uint32", "packed"])
def test_chain_accepts_every_token_form(form: str) -> None:
    tokens: object = {
        "list": TOKENS,
        "int64": np.array(TOKENS, dtype=np.int64),
        "uint32": np.array(TOKENS, dtype=np.uint32),
        "packed": le_u32(TOKENS),
    }[form]
    assert block_hashes(NS, tokens) == ref_chain(NS.id, TOKENS, B)[1:]


def test_chain_from_continues_a_chain() -> None:
    full = block_hashes(NS, TOKENS)
    tail = chain_from(full[0], le_u32(TOKENS[B:]), B)
    assert tail == full[1:]
    assert chain_hash(full[0], le_u32(TOKENS[B : 2 * B])) == full[1]


def test_chain_depends_on_namespace() -> None:
    other = make_namespace(block_tokens=B, tenant="someone-else")
    assert block_hashes(other, TOKENS) == ref_chain(other.id, TOKENS, B)[1:]
    assert not set(block_hashes(other, TOKENS)) & set(block_hashes(NS, TOKENS))


def test_short_prompt_has_no_block_hashes() -> None:
    assert block_hashes(NS, TOKENS[: B - 1]) == []
    assert block_hashes(NS, []) == []


def test_block_size_changes_the_chain() -> None:
    ns8 = make_namespace(block_tokens=8)
    toks = list(range(100, 124))
    assert block_hashes(ns8, toks) == ref_chain(ns8.id, toks, 8)[1:]


# ---------------------------------------------------------------- prefix hash


@pytest.mark.parametrize("t", range(1, len(TOKENS) + 1))
def test_prefix_hash_matches_design(t: int) -> None:
    ref = ref_chain(NS.id, TOKENS, B)
    got = prefix_hash(NS, TOKENS, t)
    assert got == ref_prefix(NS.id, TOKENS, B, t)
    if t % B == 0:
        assert got == ref[t // B]  # p(t) = h_{t/B} on a boundary
    # Passing precomputed hashes gives the same answer.
    assert prefix_hash(NS, TOKENS, t, hashes=block_hashes(NS, TOKENS)) == got


def test_prefix_hash_is_a_prefix_property() -> None:
    """p(t) depends only on tokens[:t]: a longer prompt gives the same p(t)."""
    longer = TOKENS + [5, 5, 5, 5, 5]
    for t in range(1, len(TOKENS) + 1):
        assert prefix_hash(NS, longer, t) == prefix_hash(NS, TOKENS, t)


@pytest.mark.parametrize("t", [0, -1, len(TOKENS) + 1])
def test_prefix_hash_rejects_out_of_range_t(t: int) -> None:
    with pytest.raises(ValueError, match="^t:"):
        prefix_hash(NS, TOKENS, t)


def test_prefix_hashes_are_distinct_across_positions() -> None:
    ps = [prefix_hash(NS, TOKENS, t) for t in range(1, len(TOKENS) + 1)]
    assert len(set(ps)) == len(ps)
    assert root_hash(NS) not in ps


# ---------------------------------------------------------------- extra keys


def test_extra_keys_change_exactly_the_blocks_from_the_first_carrying_one() -> None:
    toks = list(range(1000, 1000 + 6 * B))
    plain = block_hashes(NS, toks)
    extras = [b"", b"", b"lora:7", b"", b""]  # the 6th block has none (list shorter than the chain)
    got = block_hashes(NS, toks, extras)
    assert got == ref_chain(NS.id, toks, B, extras)[1:]
    assert got[:2] == plain[:2]
    for j in range(2, 6):  # the chain carries the change forward, even through blocks without an extra
        assert got[j] != plain[j]


def test_empty_extras_are_no_extras() -> None:
    toks = list(range(3 * B))
    assert block_hashes(NS, toks, [b"", b"", b""]) == block_hashes(NS, toks) == block_hashes(NS, toks, [])


def test_different_extras_give_different_chains() -> None:
    toks = list(range(3 * B))
    a = block_hashes(NS, toks, [b"img:aaaa"])
    b = block_hashes(NS, toks, [b"img:bbbb"])
    assert all(x != y for x, y in zip(a, b))


def test_tail_takes_its_blocks_extra() -> None:
    """Documented in protocol/hashing.py: p(t) mid-block appends extra_{t//B+1}, so an
    image that overlaps a partial block is never hidden by a tail."""
    toks = list(range(2 * B + 2))
    extras = [b"", b"", b"img:cafe"]
    ref = ref_chain(NS.id, toks, B, extras)
    t = 2 * B + 1
    # A tail's extra is folded into the chaining value (protocol.hashing.tail_hash).
    expected = xxhash.xxh3_128_digest(xxhash.xxh3_128_digest(ref[2] + b"img:cafe") + le_u32(toks[2 * B : t]))
    assert prefix_hash(NS, toks, t, extra_keys=extras) == expected
    assert prefix_hash(NS, toks, t, extra_keys=extras) != prefix_hash(NS, toks, t)
    # On a boundary the prefix hash is the block hash (which carries its own extra).
    assert prefix_hash(NS, toks, 2 * B, extra_keys=extras) == ref[2]


def test_tail_keys_are_unambiguous_with_extras() -> None:
    lora = struct.pack("<I", 1)  # e.g. a LoRA id packed as uint32
    with_lora = prefix_hash(NS, [5], 1, extra_keys=[lora])
    without = prefix_hash(NS, [5, 1], 2)
    assert make_entry_key(Kind.TAIL, with_lora) != make_entry_key(Kind.TAIL, without)


# ---------------------------------------------------------------- property: shared prefixes


token_lists = st.lists(st.integers(0, 7), max_size=8 * B)  # a tiny alphabet makes long shared prefixes likely


def lcp(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(a=token_lists, b=token_lists, block=st.sampled_from([1, 2, 3, 4, 16]))
def test_blocks_shared_exactly_for_the_common_prefix(a: list[int], b: list[int], block: int) -> None:
    ns = make_namespace(block_tokens=block)
    ha, hb = block_hashes(ns, a), block_hashes(ns, b)
    shared = lcp(a, b) // block
    for j in range(min(len(ha), len(hb))):
        assert (ha[j] == hb[j]) == (j < shared), (j, shared)
    # And no block hash of one list appears anywhere past the shared run of the other.
    assert not set(ha[shared:]) & set(hb[shared:])


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=6 * B))
def test_chain_and_prefix_match_reference(tokens: list[int]) -> None:
    assert block_hashes(NS, tokens) == ref_chain(NS.id, tokens, B)[1:]
    for t in range(1, len(tokens) + 1):
        assert prefix_hash(NS, tokens, t) == ref_prefix(NS.id, tokens, B, t)


# ---------------------------------------------------------------- packing


def test_pack_tokens_is_little_endian_uint32() -> None:
    assert pack_tokens([1, 2**32 - 1, 0]) == b"\x01\x00\x00\x00\xff\xff\xff\xff\x00\x00\x00\x00"
    assert pack_tokens([]) == b""
    assert pack_tokens(np.array([258], dtype=np.uint16)) == b"\x02\x01\x00\x00"
    packed = le_u32(TOKENS)
    assert pack_tokens(packed) is packed
    assert unpack_tokens(packed).tolist() == TOKENS


@pytest.mark.parametrize("bad", [
    [-1],
    [0, 1, -5],
    [2**32],
    [2**32 + 7],
    [2**64],
    np.array([-3], dtype=np.int32),
    np.array([2**32], dtype=np.int64),
    np.array([0, 2**32], dtype=np.uint64),
    np.array([5, -1], dtype=np.int16),
    np.array([-1], dtype=np.int8),
    [[1, 2], [3, 4]],
    np.zeros((2, 2), dtype=np.uint32),
    np.uint32(5),
    [1.5, 2.0],
    ["1"],
    [None],
    (1, -1),
    np.array([True, False]),
    np.array([1.0, 2.0]),
], ids=["neg", "neg-later", "2^32", "above", "2^64", "np-neg", "np-2^32", "np-u64-2^32", "np-i16-neg", "np-i8-neg", "2d-list", "2d-array", "scalar", "floats",
        "str", "none", "tuple-neg", "np-bools", "np-floats"])
def test_pack_tokens_rejects(bad: object) -> None:
    with pytest.raises(ValueError, match="^tokens"):
        pack_tokens(bad)


def test_pack_tokens_takes_python_bools_as_ints() -> None:
    """Python bools are ints (the list fast path takes them, as int() would); numpy bool arrays are refused."""
    assert pack_tokens([True, False]) == le_u32([1, 0])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=40))
def test_pack_tokens_agrees_across_input_forms(tokens: list[int]) -> None:
    """The list fast path and the numpy path produce the same bytes."""
    expected = le_u32(tokens)
    assert pack_tokens(tokens) == expected
    assert pack_tokens(tuple(tokens)) == expected
    assert pack_tokens(np.array(tokens, dtype=np.uint32)) == expected
    assert pack_tokens(np.array(tokens, dtype=np.int64)) == expected
    assert pack_tokens(np.array(tokens, dtype=np.uint64)) == expected
    small = [t for t in tokens if t < 2**31]
    assert pack_tokens(np.array(small, dtype=np.int32)) == le_u32(small)
    assert pack_tokens(np.array([t & 0xFFFF for t in tokens], dtype=np.uint16)) == le_u32([t & 0xFFFF for t in tokens])


def test_pack_tokens_rejects_ragged_bytes() -> None:
    with pytest.raises(ValueError, match="multiple of 4"):
        pack_tokens(b"\x01\x02\x03")


def test_block_hashes_reject_bad_tokens() -> None:
    with pytest.raises(ValueError):
        block_hashes(NS, [1, 2, 3, -4])


# ---------------------------------------------------------------- entry keys


def test_entry_keys_keep_kinds_apart() -> None:
    h = BlockHash(block_hashes(NS, TOKENS)[0])
    keys = {make_entry_key(k, h) for k in Kind}
    assert len(keys) == 3
    for k in Kind:
        assert split_entry_key(make_entry_key(k, h)) == (k, h)
    with pytest.raises(ValueError, match="^hash"):
        make_entry_key(Kind.BLOCK, BlockHash(b"short"))
    with pytest.raises(ValueError, match="^entry key"):
        split_entry_key(b"\x01" + h + b"x")


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), block=st.sampled_from([1, 3, 16]),
       extras=st.lists(st.binary(max_size=12), max_size=20))
def test_native_chain_equals_the_python_reference(tokens: list[int], block: int, extras: list[bytes]) -> None:
    from prefixstore.protocol import hashing

    assert hashing._native_chain is not None, "the native chain should be built (a C compiler is on CI)"
    parent = hashing.root_hash(make_namespace(block_tokens=block))
    packed = pack_tokens(tokens)
    assert hashing.chain_from(parent, packed, block, extras) == hashing.chain_from_python(parent, packed, block, extras)
    assert hashing.chain_from(parent, packed, block) == hashing.chain_from_python(parent, packed, block)
    # Joined, as a lookup sends it: the same digests back to back.
    assert hashing.chain_bytes(parent, packed, block, extras) == b"".join(
        hashing.chain_from_python(parent, packed, block, extras))
    assert hashing.chain_bytes(parent, packed, block) == b"".join(hashing.chain_from_python(parent, packed, block))


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 2**32 - 1), max_size=200), block=st.sampled_from([1, 3, 16]),
       extras=st.lists(st.binary(max_size=12), max_size=20))
def test_pack_and_chain_is_pack_then_chain_for_every_input_form(tokens: list[int], block: int,
                                                                 extras: list[bytes]) -> None:
    """The one-pass copy-and-hash of a uint32 array (protocol/_chain.c ``copy``) gives the bytes and
    the chain of pack_tokens then chain_bytes, a partial last block included; every other form
    (lists, other dtypes, byte order, strided views, bytes) takes the two-step path."""
    from prefixstore.protocol import hashing

    parent = hashing.root_hash(make_namespace(block_tokens=block))
    expected = (pack_tokens(tokens), b"".join(hashing.chain_from_python(parent, pack_tokens(tokens), block, extras)))
    arr = np.array(tokens, dtype=np.uint32)
    doubled = np.repeat(arr, 2)  # arr[::1] of a strided view: doubled[::2] is arr, not contiguous
    for form in (arr, tokens, tuple(tokens), arr.astype(">u4"), arr.astype(np.int64), doubled[::2], pack_tokens(tokens)):
        got = hashing.pack_and_chain(parent, form, block, extras)
        assert got == expected, type(form)
        assert isinstance(got[0], bytes) and isinstance(got[1], bytes)
    packed, _ = hashing.pack_and_chain(parent, arr, block, extras)
    arr[:] = 7  # the prompt keeps its own copy: the caller may reuse its array
    assert packed == expected[0]


def test_a_prompt_of_a_uint32_array_is_hashed_as_its_list_is() -> None:
    from prefixstore.client.prompt import Prompt

    tokens = list(range(5, 5 + 3 * B + 2))
    a, b = Prompt(NS, tokens), Prompt(NS, np.array(tokens, dtype=np.uint32))
    assert (a.packed, a.hash_bytes) == (b.packed, b.hash_bytes)
    assert a.hashes == block_hashes(NS, tokens)
