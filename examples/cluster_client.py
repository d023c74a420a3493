"""A cluster client: the same methods, over every node of a cluster (docs/cluster.md).

    prefixstore serve --port 8077 --node-url http://127.0.0.1:8077 --peers http://127.0.0.1:8077,http://127.0.0.1:8078 &
    prefixstore serve --port 8078 --node-url http://127.0.0.1:8078 --peers http://127.0.0.1:8077,http://127.0.0.1:8078 --data-dir none &
    python examples/cluster_client.py http://127.0.0.1:8077 [MORE SEED URLS]

Any live seed tells the client the member list. Each entry lives on its
rendezvous owner, so a prompt's blocks spread over the nodes; a lookup asks
the owners in one parallel round trip and answers as one node would.
"""

import asyncio
import sys

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Namespace

SEEDS = tuple(sys.argv[1:]) or ("http://127.0.0.1:8077",)

ns = Namespace(model="my-transformer", kv=KVLayout(num_layers=2, num_heads=4, head_dim=64), block_tokens=16)
tokens = list(range(20_000, 20_512))  # 32 blocks
kv = np.random.default_rng(0).integers(0, 256, (ns.kv.num_layers, len(tokens), ns.kv.layer_token_bytes),
                                       dtype=np.uint8)


async def main() -> None:
    async with PrefixClient(ns, ClientConfig(urls=SEEDS)) as client:  # urls=: a cluster client
        saved = await client.save(client.prompt(tokens), len(tokens), lambda a, b: kv[:, a:b].tobytes())
        print(f"saved {saved.stored} entries ({saved.already} already stored)")
        res = await client.lookup(tokens)
        reads = res.kv_reads(res.kv_tokens)
        buffers = [bytearray(ns.kv.payload_bytes(end - start)) for _, start, end in reads]
        got = await client.read([item for item, _, _ in reads], buffers)
        await client.release(res.lease_id)
        exact = all(g == len(b) and b == kv[:, s:e].tobytes() for g, b, (_, s, e) in zip(got, buffers, reads))
        print(f"lookup: kv_tokens={res.kv_tokens}; read {len(reads)} entries, exact: {exact}")
        print(f"failures: {dict(client.failures) or 'none'}")


asyncio.run(main())
