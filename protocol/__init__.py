"""Key scheme and wire format. Imports nothing else of prefixstore."""

from .hashing import (
    HASH_BYTES,
    TOKEN_BYTES,
    BlockHash,
    block_hashes,
    chain_from,
    chain_hash,
    pack_tokens,
    prefix_hash,
    root_hash,
    tail_hash,
    unpack_tokens,
)
from .keys import ENTRY_KEY_BYTES, Kind, Origin, make_entry_key, split_entry_key
from .namespace import DTYPE_BYTES, HASH_SCHEME_VERSION, KVLayout, Namespace, NamespaceError, StateLayout

__all__ = [
    "DTYPE_BYTES", "ENTRY_KEY_BYTES", "HASH_BYTES", "HASH_SCHEME_VERSION", "TOKEN_BYTES", "BlockHash",
    "KVLayout", "Kind", "Origin", "Namespace", "NamespaceError", "StateLayout", "block_hashes", "chain_from",
    "chain_hash", "make_entry_key", "tail_hash", "pack_tokens", "prefix_hash", "root_hash", "split_entry_key",
    "unpack_tokens",
]
