"""A cluster client: the same methods, over a cluster of nodes (docs/cluster.md).

    prefixstore serve --port 8077 --node-url http://127.0.0.1:8077 --peers http://127.0.0.1:8077,http://127.0.0.1:8078 &
    prefixstore serve --port 8078 --node-url http://127.0.0.1:8078 --peers http://127.0.0.1:8077,http://127.0.0.1:8078 --data-dir none &
    python examples/cluster_client.py http://127.0.0.1:8077 [MORE SEED URLS]

Any live seed tells the client the member list. The cluster places branches of
the prefix tree: a conversation stays on one node, conversations under a shared
system prompt fork onto different nodes, so a lookup asks one or two nodes
whatever the cluster's size, and answers exactly as one node would.
"""

import asyncio
import sys

import numpy as np

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.protocol import KVLayout, Namespace

SEEDS = tuple(sys.argv[1:]) or ("http://127.0.0.1:8077",)

ns = Namespace(model="my-transformer", kv=KVLayout(num_layers=2, num_heads=4, head_dim=64), block_tokens=16)
system = list(range(20_000, 20_064))  # a shared system prompt: 4 blocks
conversations = [system + list(range(30_000 + 1000 * k, 30_000 + 1000 * k + 448)) for k in range(16)]
rng = np.random.default_rng(0)
kv = {k: rng.integers(0, 256, (ns.kv.num_layers, len(c), ns.kv.layer_token_bytes), dtype=np.uint8)
      for k, c in enumerate(conversations)}
for k in kv:  # the system prompt's KV is the same in every conversation
    kv[k][:, : len(system)] = kv[0][:, : len(system)]


async def main() -> bool:
    async with PrefixClient(ns, ClientConfig(urls=SEEDS)) as client:  # urls=: a cluster client
        stored = 0
        for k, tokens in enumerate(conversations):
            saved = await client.save(client.prompt(tokens), len(tokens), lambda a, b, k=k: kv[k][:, a:b].tobytes())
            stored += saved.stored
        print(f"saved {len(conversations)} conversations ({stored} entries)")
        exact_all, most_nodes = True, 0
        for k, tokens in enumerate(conversations):
            res = await client.lookup(tokens)
            reads = res.kv_reads(res.kv_tokens)
            buffers = [bytearray(ns.kv.payload_bytes(end - start)) for _, start, end in reads]
            got = await client.read([item for item, _, _ in reads], buffers)
            await client.release(res.lease_id)
            exact_all &= res.kv_tokens == len(tokens) and all(
                g == len(b) and b == kv[k][:, s:e].tobytes() for g, b, (_, s, e) in zip(got, buffers, reads))
            walk = getattr(client.impl, "last_walk", None)  # the cluster client's diagnostics (None: one node)
            most_nodes = max(most_nodes, len(walk.nodes) if walk is not None else 1)
        print(f"lookups: every conversation whole and exact: {exact_all}; most nodes asked by one lookup: {most_nodes}")
        print(f"failures: {dict(client.failures) or 'none'}")
        return exact_all and stored > 0


sys.exit(0 if asyncio.run(main()) else 1)
