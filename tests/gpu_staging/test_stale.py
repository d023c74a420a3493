"""No byte of one request reaches another through the staging region (DESIGN §9).

Request A loads a long prefix, leaving its KV all over the staging region.
Request B then reuses the same region for a shorter transfer: a tail that
covers less than A's payloads did, or a transfer that fails outright.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from prefixstore.client import PrefixClient, Prompt
from prefixstore.client.results import LookupResult
from prefixstore.gpu_staging import HybridModel, LayerwiseLoad, LoadFailed, RecurrentState, ReusePlan, recompute_logits
from prefixstore.protocol.wire import GetItem

from ..conftest import RunningStore
from .conftest import MakeEngine, StartStore, store_config, tokens

TOL = 1e-5


async def test_a_shorter_transfer_reads_only_its_own_bytes(tmp_path: Path, start_store: StartStore,
                                                           make_engine: MakeEngine, model: HybridModel) -> None:
    running = await start_store(store_config(tmp_path))
    engine = await make_engine(running, block_tokens=16, page_tokens=16)
    a, b = tokens(50, 64), tokens(51, 13)
    await engine.generate(a, 1)
    await engine.generate(b, 1)  # B's prefix is one 13-token tail

    result_a = await engine.generate(a + tokens(52, 5), 2, save=False)
    assert result_a.plan.kv_tokens == 64
    ns = engine.client.namespace
    dirty = engine.staging.host[: 64 * ns.kv.layer_token_bytes].clone()  # A's last round: KV layer 1, 4 blocks
    assert dirty.any()

    prompt_b = b + tokens(53, 5)
    result_b = await engine.generate(prompt_b, 2, save=False)
    assert result_b.plan == ReusePlan(kv_tokens=13, load_state=True) and result_b.fallback is None
    assert float((result_b.logits[0] - recompute_logits(model, prompt_b)).abs().max()) <= TOL

    # B's last round was its tail's layer-1 payload: exactly the store's bytes, where A's lay before.
    tail_key = engine.client.prompt(b).kv_key_ending_at(13)
    expected = bytearray(13 * ns.kv.layer_token_bytes)
    assert await engine.client.read([GetItem(key=tail_key, layer_start=1, layer_end=2)], [expected]) == [len(expected)]
    region = engine.staging.host[: len(expected)].numpy().tobytes()
    assert region == bytes(expected)
    assert region != dirty[: len(expected)].numpy().tobytes()


class StopAfterLookup(PrefixClient):
    """A real client whose store goes away between the lookup and the reads (a node dying)."""

    running: RunningStore | None = None

    async def lookup(self, prompt: Prompt | Sequence[int] | np.ndarray, lease: bool | None = None) -> LookupResult:
        result = await super().lookup(prompt, lease)
        if self.running is not None:
            await self.running.server.close()
        return result


async def test_a_failed_transfer_leaves_zeros_and_the_request_recomputes(
        tmp_path: Path, start_store: StartStore, make_engine: MakeEngine, model: HybridModel) -> None:
    # HTTP only: closing the server is a node's death for HTTP reads, but over NIXL (cma) this
    # process's arena stays readable after it; tests/nixl kills a real store process instead.
    running = await start_store(store_config(tmp_path, nixl="off"))
    engine = await make_engine(running, block_tokens=16, page_tokens=16, client_cls=StopAfterLookup)
    a, b = tokens(60, 64), tokens(61, 29)
    await engine.generate(a, 1)
    await engine.generate(b, 1)
    await engine.generate(a + tokens(62, 3), 1, save=False)  # A's KV and snapshot now fill the region
    snapshot_bytes = engine.client.namespace.state.snapshot_bytes
    assert engine.staging.host[:snapshot_bytes].any()

    assert isinstance(engine.client, StopAfterLookup)
    engine.client.running = running
    prompt_b = b + tokens(63, 4)
    result = await engine.generate(prompt_b, 3)
    assert (result.kv_tokens, result.state_tokens) == (29, 29)  # the lookup promised 29 tokens ...
    assert result.fallback is not None and result.plan == ReusePlan()  # ... the reads failed: recomputed
    reference = recompute_logits(model, prompt_b + result.generated[:-1], all_logits=True)[len(prompt_b) - 1 :]
    assert float((result.logits - reference).abs().max()) <= TOL
    # The snapshot read was the first transfer of B; it failed, and its slot holds zeros, not A's state.
    assert not engine.staging.host[:snapshot_bytes].any()
    assert engine.staging.zeroed_bytes >= snapshot_bytes
    assert result.save is not None and result.save.stored == 0  # the save was dropped, not raised


async def test_a_failed_layer_stops_the_compute_and_is_zeroed(tmp_path: Path, start_store: StartStore,
                                                                make_engine: MakeEngine, model: HybridModel) -> None:
    """A load that fails after layer 0: the waiter on the failed layer raises, nothing stale is scattered."""
    running = await start_store(store_config(tmp_path, nixl="off"))  # HTTP only, as above
    engine = await make_engine(running, block_tokens=16, page_tokens=16)
    a = tokens(70, 48)
    await engine.generate(a, 1)
    engine.staging.host.fill_(0x5A)
    lookup = await engine.client.lookup(a + [1, 2, 3])
    seq = engine.cache.sequence()
    seq.reserve(48)
    seq.cache.data.zero_()
    load = LayerwiseLoad(engine.client, lookup, kv_tokens=48, seq=seq, state=RecurrentState(model.config),
                         staging=engine.staging, config=model.config)

    original = load._load_layer

    async def fail_on_layer_1(kv_layer: int) -> None:
        if kv_layer == 1:
            await running.server.close()  # the node dies between the two layers' reads
        await original(kv_layer)

    load._load_layer = fail_on_layer_1
    assert not await load.run()
    for layer in model.config.attention_layers:  # a partial load is never used: every wait raises
        with pytest.raises(LoadFailed, match="KV layer 1"):
            load.wait_for_layer(layer)
    # Layer 1's round failed whole: its slots are zeros and its pages received nothing.
    layer_bytes = 48 * engine.client.namespace.kv.layer_token_bytes
    assert not engine.staging.host[:layer_bytes].any()
    assert not engine.cache.layer(1)[seq.pages].any()
    assert engine.cache.layer(0)[seq.pages].any()
    seq.release()
