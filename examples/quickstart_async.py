"""Quick start (async): save a prompt's KV and a state snapshot, look the prompt up, read it back.

    prefixstore serve &                          # a store on 127.0.0.1:8077
    python examples/quickstart_async.py [URL]

The engine's KV and state are made up here (random bytes in the store's layout);
an engine passes its own. tests/examples/ runs this file against a real store.
"""

import asyncio
import sys

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Namespace, StateLayout

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8077"

ns = Namespace(model="my-hybrid", kv=KVLayout(num_layers=2, num_heads=8, head_dim=128),
               state=StateLayout(num_layers=6, shapes=((8, 128, 128),)), block_tokens=16)
tokens = list(range(1000, 1100))  # a 100-token prompt: 6 full blocks and a 4-token tail
n = len(tokens)
rng = np.random.default_rng(0)
kv = rng.integers(0, 256, (ns.kv.num_layers, n, ns.kv.layer_token_bytes), dtype=np.uint8)  # layer-major
state = rng.integers(0, 256, ns.state.snapshot_bytes, dtype=np.uint8)  # the state after all n tokens


def kv_payload(a: int, b: int) -> bytes:
    """The store-layout (layer-major) KV of tokens [a, b)."""
    return kv[:, a:b].tobytes()


async def main() -> bool:
    async with PrefixClient(ns, ClientConfig(url=URL)) as client:
        prompt = client.prompt(tokens)
        # Offer KV [0, n) and a snapshot at n; only what the store wants is sent.
        saved = await client.save(prompt, n, kv_payload, snapshots={n: state})
        print(f"saved {saved.stored} entries ({saved.already} already stored, {saved.rejected} rejected)")

        res = await client.lookup(tokens)  # one round trip, leased
        print(f"lookup: kv_tokens={res.kv_tokens} state_tokens={res.state_tokens}")
        reads = res.kv_reads(res.kv_tokens)  # (GetItem, token_start, token_end) per entry
        buffers = [bytearray(ns.kv.payload_bytes(end - start)) for _, start, end in reads]
        got = await client.read([item for item, _, _ in reads], buffers)  # bytes per item, or -1 = miss
        snapshot = res.state_read()
        state_buffer = bytearray(ns.state.snapshot_bytes)
        got_state = await client.read([snapshot], [state_buffer]) if snapshot is not None else [-1]
        await client.release(res.lease_id)  # the entries may be evicted again

        # Nothing read is no success: a dead store or a refused token is a miss, never an exception.
        exact = bool(reads) and all(g == len(buf) and buf == kv_payload(a, b)
                                    for g, buf, (_, a, b) in zip(got, buffers, reads))
        state_exact = got_state[0] > 0 and state_buffer == state.tobytes()
        print(f"read {len(reads)} KV entries ({sum(max(g, 0) for g in got)} bytes), exact: {exact}; "
              f"snapshot exact: {state_exact}")
        print(f"failures: {dict(client.failures) or 'none'}")
        return exact and state_exact


sys.exit(0 if asyncio.run(main()) else 1)
