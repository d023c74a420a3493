"""LMCache's chunk keys -> store entries.

LMCache hands a remote connector one ``CacheEngineKey`` per chunk: the model
name, world size, worker id, dtype, request tags and ``chunk_hash``, LMCache's
hash of the chunk's tokens chained from the sequence start
(``lmcache/v1/token_database.py``). It never hands the tokens, nor the key of
the chunk before (``put``, ``get`` and ``exists`` take one key; batched calls
are lists of independent keys).

So each chunk is one store entry directly under the namespace root: a block
of ``chunk_size`` tokens, or a tail for the last, shorter chunk of a
sequence::

    h = xxh3_128(h_0 || pseudo_tokens(key) || extra = key.to_string())

* The extra is the whole key string; the store compares a stored entry's
  extra before its tokens, so no lookup ever completes a match inside an entry
  of another key: a hit is the key's own bytes or nothing.
* The pseudo-tokens are the words of xxh3_128(key string). Deriving them from
  the key, not zeros, spreads a cluster's placement (a level's parent and
  first token pick its node) and lets a lookup find a key's tail among the
  root's children by its first tokens.

Correct because LMCache's chunk hash chains over every token before it: equal
keys mean equal prefixes, within LMCache's own hash (choose a cryptographic
one with LMCache's ``pre_caching_hash_algorithm``; docs/lmcache.md). The price
of opaque keys: entries are shared by LMCache instances with the same
namespace and by no other engine, which the namespace states (``KEYSPACE``).
"""

from __future__ import annotations

import numpy as np
import xxhash

from prefixstore.protocol.namespace import Namespace
from ..prompt import Prompt

KEYSPACE = "keys:lmcache-chunk-hash"
"""Recorded in the namespace revision: entries are keyed by LMCache's chunk keys, not tokens."""


def chunk_prompt(namespace: Namespace, key: str, num_tokens: int) -> Prompt:
    """The store's view of one chunk of ``num_tokens`` tokens whose LMCache key string is ``key``."""
    extra = key.encode("utf-8")
    words = np.frombuffer(xxhash.xxh3_128_digest(extra), dtype="<u4")
    return Prompt(namespace, np.resize(words, num_tokens), [extra])


__all__ = ["KEYSPACE", "chunk_prompt"]
