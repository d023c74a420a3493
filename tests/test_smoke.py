from __future__ import annotations

from prefixstore.client import PrefixClient

from .conftest import RunningStore
from .factories import kv_payload, make_namespace, state_payload


async def test_save_lookup_read_roundtrip(running: RunningStore, client: PrefixClient) -> None:
    ns = client.namespace
    toks = list(range(100, 111))
    p = client.prompt(toks)
    r = await client.save(p, 11, lambda a, b: kv_payload(ns, toks, a, b), {7: state_payload(ns, toks, 7)})
    assert (r.stored, r.rejected, r.dropped) == (4, 0, 0)
    res = await client.lookup(toks[:10] + [5, 6])
    assert (res.kv_tokens, res.state_tokens, res.checkpoint_hint) == (10, 7, 10)
    reads = res.kv_reads(res.kv_tokens)
    outs = [bytearray(4 * ns.kv.token_bytes) for _ in reads]
    got = await client.read([it for it, _, _ in reads], outs)
    assert got == [256, 256, 192]
    assert bytes(outs[2]) [: 2 * ns.kv.layer_token_bytes] == kv_payload(ns, toks, 8, 11)[: 2 * ns.kv.layer_token_bytes]
    running.store.check()
    assert make_namespace() == ns
