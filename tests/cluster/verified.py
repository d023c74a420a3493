"""Reading back what a cluster lookup named, every byte checked against the true payloads.

The one check behind the cluster tests' "a read may miss, never be wrong": each KV entry the
lookup matched is read (the last one may be a stored child of which only the first tokens are
the prompt's: only those are compared) and the snapshot it named, if any.
"""

from __future__ import annotations

from prefixstore.client import PrefixClient
from prefixstore.client.results import LookupResult
from prefixstore.protocol.namespace import Namespace

from ..factories import kv_payload, state_payload


async def read_verified(client: PrefixClient, ns: Namespace, tokens: list[int], res: LookupResult) -> int:
    """Read KV [0, kv_tokens) and the snapshot of ``res``; assert that every payload read is exactly
    the true one for ``tokens``. Returns how many reads missed."""
    reads = res.kv_reads(res.kv_tokens) if res.kv_tokens else []
    items = [it for it, _, _ in reads]
    bufs = [bytearray(ns.kv.payload_bytes(ns.block_tokens)) for _ in reads]
    state = res.state_read()
    if state is not None:
        items.append(state)
        bufs.append(bytearray(ns.state.snapshot_bytes))
    if not items:
        return 0
    got = await client.read(items, bufs)
    per = ns.kv.layer_token_bytes
    for (_, a, b), buf, size in zip(reads, bufs, got):
        if size < 0:
            continue
        stored = size // ns.kv.token_bytes  # tokens the entry holds, layer after layer
        used = b"".join(bytes(buf[layer * stored * per: layer * stored * per + (b - a) * per])
                        for layer in range(ns.kv.num_layers))
        assert stored >= b - a and used == kv_payload(ns, tokens, a, b), (a, b, size)
    if state is not None and got[-1] >= 0:
        assert bytes(bufs[-1][: got[-1]]) == state_payload(ns, tokens, res.state_tokens)
    return sum(g < 0 for g in got)


__all__ = ["read_verified"]
