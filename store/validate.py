"""What an item or a namespace must be before the store takes it: pure checks, no state.

Used by the write path (every offer and put) and by the restart scan (every record read back
from LMDB is checked as a put of it would have been), so a record on disk can never hold what
a put would have been refused for.
"""

from __future__ import annotations

from prefixstore.protocol.errors import Problem
from prefixstore.protocol.hashing import TOKEN_BYTES, BlockHash, chain_hash, tail_hash
from prefixstore.protocol.keys import Kind
from prefixstore.protocol.namespace import Namespace
from prefixstore.protocol.wire import ItemSpec, WireError
from .index import Entry


def check_item(ns: Namespace, item: ItemSpec, ctx: str) -> None:
    """Everything about an item that does not depend on what is stored: kind, token count, size
    from the layout, and (blocks and tails) the hash recomputed from parent, tokens and extra."""
    B = ns.block_tokens
    if item.kind is Kind.STATE:
        if not ns.has_state:
            raise WireError(f"{ctx}kind", "this namespace has no state layout, so it holds no snapshots")
        if item.size != ns.state.snapshot_bytes:
            raise WireError(f"{ctx}size", f"a snapshot of this namespace is {ns.state.snapshot_bytes} bytes, got {item.size}")
        return
    n = item.num_tokens
    if item.record and (item.kind is not Kind.BLOCK or item.size != 0):
        raise WireError(f"{ctx}record", "a fork record is a block's, with size 0 (no payload)")
    if item.kind is Kind.BLOCK and n != B:
        raise WireError(f"{ctx}tokens", f"a block holds exactly {B} tokens, got {n}")
    if item.kind is Kind.TAIL and not 0 < n < B:
        raise WireError(f"{ctx}tokens", f"a tail holds 1 to {B - 1} tokens, got {n}")
    if ns.kv.token_bytes == 0:
        raise WireError(f"{ctx}kind", "this namespace has no KV layout")
    expected = 0 if item.record else ns.kv.payload_bytes(n)
    if item.size != expected:
        raise WireError(f"{ctx}size", f"{n} tokens of this namespace's KV are {expected} bytes, got {item.size}")
    assert item.parent is not None
    link = chain_hash if item.kind is Kind.BLOCK else tail_hash
    if link(item.parent, item.tokens, item.extra) != item.hash:
        raise WireError(f"{ctx}hash", "does not equal the hash of parent, tokens and extra (protocol/hashing.py)")


def snapshot_hash(container: Entry, boundary: int) -> BlockHash | None:
    """p(boundary) of a snapshot registered in ``container``; None when the boundary lies outside
    the container's token range (start, end]."""
    if not container.start < boundary <= container.end:
        return None
    assert container.parent is not None
    off = boundary - container.start
    if boundary == container.end:
        return container.hash
    return tail_hash(container.parent, container.tokens[: off * TOKEN_BYTES], container.extra)


def check_namespace(ns: Namespace, max_body_bytes: int) -> None:
    """What a store with ``max_body_bytes`` can hold of a namespace the protocol accepts: a block or
    a snapshot larger than one put body could never be stored."""
    if ns.block_bytes > max_body_bytes:
        raise WireError("namespace.kv", f"a block is {ns.block_bytes} bytes, more than max_body_bytes={max_body_bytes}")
    if ns.state.snapshot_bytes > max_body_bytes:
        raise WireError("namespace.state", f"a snapshot is {ns.state.snapshot_bytes} bytes, more than "
                        f"max_body_bytes={max_body_bytes}", Problem.INVALID)


__all__ = ["check_item", "check_namespace", "snapshot_hash"]
