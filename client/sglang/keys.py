"""SGLang's page keys -> the store's hash chain.

SGLang hands a storage backend only its own page keys: for page j of a
sequence, ``sha256(key_{j-1} || tokens of page j)`` as 64 hex digits, seeded by
the request's extra key and cache salt (``sglang.srt.mem_cache.utils
.get_storage_hash_str``). With ``hicache_storage_pass_prefix_keys`` it also
hands the keys of every page before the call's first one, so ``prefix_keys +
keys`` is the sequence's chain from its first page. It never hands the token
ids (HiCacheStorageExtraInfo carries none; the controller keeps them in its
own StorageOperation).

So the store's chain is built from the keys, one store block per SGLang page
(namespace ``block_tokens`` = SGLang's ``page_size``)::

    h_0   = xxh3_128(namespace id)                      (the store's root)
    h_j   = xxh3_128(h_{j-1} || pseudo_tokens(key_j) || extra_j = key_j)

* ``extra_j`` is SGLang's key itself. The store compares a stored child's
  extra before its tokens (store/index.py), so a lookup can never complete a
  match inside a page whose key differs: no partial-page reuse, no wrong bytes.
* ``pseudo_tokens(key_j)`` fill the block's token slots with the words of
  ``xxh3_128(key_j)``. The store never reads meaning into them; they exist
  because every block carries ``block_tokens`` token ids, and deriving them
  from the key (rather than zeros) spreads a cluster's placement, which hashes
  a level's parent and first token (protocol/placement.py): with zeros every
  fork under one parent would land on one node.

Correctness rests on SGLang's keys: each commits to every token before it
(SHA-256 chain), so equal keys mean equal prefixes. The price of opaque keys
is that these blocks never meet the token-keyed blocks other engines store,
which is why the namespace names the keyspace (``KEYSPACE`` in its revision):
entries are shared by every SGLang instance with the same namespace, and by no
other engine. Sharing with vLLM needs SGLang to hand the token ids to storage
backends (docs/sglang.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import xxhash

from prefixstore.protocol.namespace import Namespace
from ..prompt import Prompt

KEYSPACE = "keys:sglang-page-sha256"
"""Recorded in the namespace revision: these chains are keyed by SGLang's page keys, not tokens."""


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


__all__ = ["KEYSPACE", "key_bytes", "page_prompt", "pseudo_tokens"]
