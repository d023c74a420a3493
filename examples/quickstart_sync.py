"""Quick start (blocking): the same calls as the async client, on a private event loop.

    prefixstore serve &                          # a store on 127.0.0.1:8077
    python examples/quickstart_sync.py [URL]
"""

import sys

import numpy as np

from prefixstore.client import ClientConfig, SyncPrefixClient
from prefixstore.protocol import KVLayout, Namespace

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8077"

ns = Namespace(model="my-transformer", kv=KVLayout(num_layers=4, num_heads=8, head_dim=64), block_tokens=16)
tokens = list(range(5000, 5064))  # a 64-token prompt: 4 blocks
kv = np.random.default_rng(0).integers(0, 256, (ns.kv.num_layers, len(tokens), ns.kv.layer_token_bytes),
                                       dtype=np.uint8)

with SyncPrefixClient(ns, ClientConfig(url=URL)) as client:
    saved = client.save(client.prompt(tokens), len(tokens), lambda a, b: kv[:, a:b].tobytes())
    print(f"saved {saved.stored} entries ({saved.already} already stored)")

    res = client.lookup(tokens + [7, 8, 9])  # a longer prompt: its first 64 tokens are stored
    print(f"lookup: kv_tokens={res.kv_tokens} of {res.num_tokens}")
    reads = res.kv_reads(res.kv_tokens)
    buffers = [bytearray(ns.kv.payload_bytes(end - start)) for _, start, end in reads]
    got = client.read([item for item, _, _ in reads], buffers)
    client.release(res.lease_id)  # always release what a lookup leased
    exact = bool(reads) and all(g == len(buf) and buf == kv[:, a:b].tobytes()
                                for g, buf, (_, a, b) in zip(got, buffers, reads))
    print(f"read {len(reads)} KV entries, exact: {exact}")
    print(f"failures: {dict(client.failures) or 'none'}")  # a dead store or a refused token: misses, counted
sys.exit(0 if exact else 1)
