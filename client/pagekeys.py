"""SGLang's page keys and the store's chain over them: the keyspace SGLang and vLLM share.

SGLang hands a storage backend only its own page keys, never token ids: for page j of a
sequence, ``sha256(key_{j-1} || tokens of page j as uint32 LE)`` as 64 hex digits, the first
page seeded by the request's extra key and cache salt when it has them
(``sglang.srt.mem_cache.utils.get_storage_hash_str``). So the store's chain over SGLang's pages is
built from the keys, one store block per page (namespace ``block_tokens`` = SGLang's page size)::

    h_0   = xxh3_128(namespace id)                      (the store's root)
    h_j   = xxh3_128(h_{j-1} || pseudo_tokens(key_j) || extra_j = key_j)

* ``extra_j`` is SGLang's key itself. The store compares a stored child's extra before its
  tokens (store/index.py), so a lookup never completes a match inside a page whose key differs.
* ``pseudo_tokens(key_j)`` fill the block's token slots with the words of ``xxh3_128(key_j)``:
  every block carries ``block_tokens`` token ids, and deriving them from the key (not zeros)
  spreads a cluster's placement, which hashes a level's parent and first token.

An engine that has the token ids (vLLM) computes the same keys (:func:`page_keys`) and so the
same chain (:func:`keyed_prompt`): that is how vLLM and SGLang share one cache for one model. It
keeps real token ids after the last full page (a tail, a snapshot inside a page), under an empty
extra, so its mid-page matches never meet an SGLang page (whose extra is its key) and stay
token-exact among vLLM engines. Correctness rests on the keys: each commits to every token before
it (a SHA-256 chain), so equal keys mean equal prefixes. Which keyspace a namespace's chains use
is in its revision (:data:`KEYSPACE`): they never mix with token-keyed chains.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import xxhash

from ..protocol.namespace import Namespace
from .prompt import Prompt

KEYSPACE = "keys:sglang-page-sha256"
"""Recorded in the namespace revision: these chains are keyed by SGLang's page keys, not tokens."""

SALT_PREFIX = b"salt:"
"""The extra key a request's cache salt becomes in the token keyspace (client/vllm/scheduler.py);
in this keyspace the salt seeds the page keys instead, as SGLang seeds them."""


def key_bytes(key: str) -> bytes:
    """The extra key a page key becomes (any string SGLang hands over, hex or not)."""
    return key.encode("utf-8")


def pseudo_tokens(keys: Sequence[str], page_tokens: int) -> np.ndarray:
    """``page_tokens`` token slots per key, filled with the little-endian words of xxh3_128(key)."""
    out = np.empty((len(keys), page_tokens), dtype="<u4")
    for i, key in enumerate(keys):
        words = np.frombuffer(xxhash.xxh3_128_digest(key_bytes(key)), dtype="<u4")
        out[i] = np.resize(words, page_tokens)
    return out.reshape(-1)


def page_prompt(namespace: Namespace, keys: Sequence[str]) -> Prompt:
    """The store's view of a sequence whose pages have SGLang keys ``keys`` (from its first page)."""
    return Prompt(namespace, pseudo_tokens(keys, namespace.block_tokens), [key_bytes(k) for k in keys])


def namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """The digest SGLang seeds a request's first page with (None: unseeded): sha256 of a tag and,
    per part, absent (0x00) or present (0x01, its UTF-8 length as u64 LE, its bytes)."""
    if extra_key is None and cache_salt is None:
        return None
    digest = hashlib.sha256(b"sglang-cache-namespace-v1")
    for part in (extra_key, cache_salt):
        if part is None:
            digest.update(b"\x00")
            continue
        encoded = part.encode("utf-8")
        digest.update(b"\x01" + len(encoded).to_bytes(8, "little") + encoded)
    return digest.digest()


def page_keys(tokens: Sequence[int] | np.ndarray, page_tokens: int, cache_salt: str | None = None,
              extra_key: str | None = None) -> list[str]:
    """SGLang's keys of the full pages of ``tokens``: each the SHA-256 of the previous key's digest
    (or the seed) and the page's token ids as uint32 little-endian, in hex."""
    ids = np.asarray(tokens, dtype=np.int64)
    if len(ids) and (ids.min() < 0 or ids.max() > 0xFFFFFFFF):
        raise ValueError("token ids must fit in uint32")
    packed = ids.astype("<u4").tobytes()
    prior = namespace_seed(extra_key, cache_salt)
    out: list[str] = []
    step = 4 * page_tokens
    for j in range(len(ids) // page_tokens):
        h = hashlib.sha256()
        if prior is not None:
            h.update(prior)
        h.update(packed[j * step : (j + 1) * step])
        prior = h.digest()
        out.append(h.hexdigest())
    return out


def keyed_prompt(namespace: Namespace, tokens: Sequence[int] | np.ndarray, cache_salt: str | None = None) -> Prompt:
    """The store's view of a token sequence in SGLang's keyspace: its full pages by their keys (what
    SGLang stores), then its real token ids after the last full page, under no extra."""
    P = namespace.block_tokens
    ids = np.asarray(tokens, dtype=np.int64)
    keys = page_keys(ids, P, cache_salt)
    full = len(keys) * P
    merged = np.concatenate([pseudo_tokens(keys, P).astype(np.int64), ids[full:]])
    return Prompt(namespace, merged, [key_bytes(k) for k in keys])


__all__ = ["KEYSPACE", "SALT_PREFIX", "key_bytes", "keyed_prompt", "namespace_seed", "page_keys", "page_prompt",
           "pseudo_tokens"]
