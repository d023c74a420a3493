"""An engine that loads reused prefixes from the store, layer by layer, into its paged KV cache.

    prefixstore serve &                          # a store on 127.0.0.1:8077
    python examples/gpu_staging_load.py [URL]    # needs torch; runs on the GPU when there is one

The reference hybrid model (gpu_staging/reference_model.py: delta-rule and
attention layers, seeded weights) answers a prompt, then a follow-up turn
that replays the whole conversation: the second request loads the first's
KV and state snapshot instead of recomputing them, and decodes the same
tokens a full recompute does.
"""

import asyncio
import sys

import torch

from prefixstore.client import ClientConfig, PrefixClient
from prefixstore.gpu_staging import Engine, EngineConfig, HybridModel, ModelConfig

URL = sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8077"


async def main() -> bool:
    model = HybridModel(ModelConfig(seed=0)).to("cuda" if torch.cuda.is_available() else "cpu")
    async with PrefixClient(model.config.namespace(block_tokens=16), ClientConfig(url=URL)) as client:
        engine = Engine(model, client, EngineConfig(mode="exact", page_tokens=16))
        prompt = list(range(1, 301))
        first = await engine.generate(prompt, max_new_tokens=16)  # computes, then saves KV + snapshots
        follow_up = prompt + first.generated + list(range(400, 464))  # the next turn replays it all
        second = await engine.generate(follow_up, max_new_tokens=16)  # loads what the first saved
        print(f"first:  computed {first.computed_tokens} of {first.prompt_tokens} prompt tokens")
        print(f"second: kv_tokens={second.kv_tokens} state_tokens={second.state_tokens}, loaded "
              f"{second.loaded_bytes} bytes, computed {second.computed_tokens} of {second.prompt_tokens}")
        reference = await engine.generate(follow_up, max_new_tokens=16, use_store=False, save=False)
        print(f"same tokens as a full recompute: {second.generated == reference.generated}")
        print(f"failures: {dict(client.failures) or 'none'}")
        return second.loaded_bytes > 0 and second.generated == reference.generated


sys.exit(0 if asyncio.run(main()) else 1)
