"""A store hit is exact: logits after reuse equal full recompute (max abs diff <= 1e-5).

Every case runs the reference engine against a real store: a first request
computes from scratch and saves KV and snapshots as the retention planner
says; a second request whose reusable prefix ends at the place under test
loads it and computes the rest. Its logits -- the first token's and every
decoded one's -- are compared with a full recompute of the same tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from prefixstore.gpu_staging import HybridModel, RequestResult, ReusePlan, recompute_logits

from .conftest import MakeEngine, StartStore, store_config, tokens

TOL = 1e-5
NEW = 4  # tokens decoded by the requests under test

# (engine page size, store block size): equal, and page size != block size both ways.
LAYOUTS = [pytest.param(16, 16, id="page16-block16"), pytest.param(6, 16, id="page6-block16"),
           pytest.param(5, 8, id="page5-block8")]


def assert_exact(model: HybridModel, prompt: list[int], result: RequestResult) -> None:
    """Every logit the request produced equals a full recompute of the same tokens."""
    seen = prompt + result.generated[:-1]
    reference = recompute_logits(model, seen, all_logits=True)[len(prompt) - 1 :]
    assert result.logits.shape == reference.shape
    diff = float((result.logits - reference).abs().max())
    assert diff <= TOL, f"max abs logit difference {diff:.3g} > {TOL}"
    assert result.generated == reference.argmax(-1).tolist()


@pytest.mark.parametrize(("page_tokens", "block_tokens"), LAYOUTS)
@pytest.mark.parametrize("cached", [32, 37], ids=["block-boundary", "mid-block-tail"])
async def test_reuse_up_to_a_prompt_end(tmp_path: Path, start_store: StartStore, make_engine: MakeEngine,
                                        model: HybridModel, page_tokens: int, block_tokens: int, cached: int) -> None:
    """(a) the prefix ends on a store-block boundary, (b) mid-block through a tail; (d) page != block."""
    running = await start_store(store_config(tmp_path))
    engine = await make_engine(running, block_tokens=block_tokens, page_tokens=page_tokens)
    first = tokens(1, cached)
    seeded = await engine.generate(first, 1)  # stores KV [0, cached) and the snapshot at the prompt end
    assert seeded.snapshots == (cached,) and seeded.save is not None and seeded.save.rejected == 0

    prompt = first + tokens(2, 20)
    result = await engine.generate(prompt, NEW)
    assert (result.kv_tokens, result.state_tokens) == (cached, cached)
    assert result.plan == ReusePlan(kv_tokens=cached, load_state=True) and result.fallback is None
    assert result.computed_tokens == 20
    assert_exact(model, prompt, result)
    running.store.check()


@pytest.mark.parametrize(("page_tokens", "block_tokens"), LAYOUTS)
async def test_reuse_up_to_a_snapshot_at_an_odd_offset_inside_a_block(
        tmp_path: Path, start_store: StartStore, make_engine: MakeEngine, model: HybridModel,
        page_tokens: int, block_tokens: int) -> None:
    """(c) a snapshot at 21, inside a block whose stored KV goes further."""
    running = await start_store(store_config(tmp_path))
    engine = await make_engine(running, block_tokens=block_tokens, page_tokens=page_tokens)
    first = tokens(3, 21)
    seeded = await engine.generate(first, 15)  # snapshots at 21 (prompt end) and 35 (= 21 + 15 - 1)
    assert seeded.snapshots == (21, 35)
    stored = first + seeded.generated[:-1]

    # A branch at 21: the match ends inside a stored block of which only the first tokens agree.
    branch = first + tokens(4, 19)
    result = await engine.generate(branch, NEW)
    assert (result.kv_tokens, result.state_tokens) == (21, 21)
    assert result.plan == ReusePlan(kv_tokens=21, load_state=True) and result.fallback is None
    assert_exact(model, branch, result)

    # Following the stored sequence past the snapshot: KV is stored to 30, the state only at 21.
    onward = stored[:30] + tokens(5, 10)
    result = await engine.generate(onward, NEW)
    assert (result.kv_tokens, result.state_tokens, result.checkpoint_hint) == (30, 21, 30)
    assert result.plan == ReusePlan(kv_tokens=21, load_state=True)
    assert 30 in result.snapshots  # the junction hint became a chunk boundary and a snapshot
    assert_exact(model, onward, result)
    running.store.check()


async def test_reuse_after_demotion_to_the_lmdb_tier(tmp_path: Path, start_store: StartStore,
                                                      make_engine: MakeEngine, model: HybridModel) -> None:
    """(e) a RAM arena of 16 pages: the entries are demoted to LMDB and read back from there."""
    running = await start_store(store_config(tmp_path, ram_bytes=1 << 20, page_bytes=64 << 10))
    engine = await make_engine(running, block_tokens=16, page_tokens=6)
    first = tokens(6, 37)
    await engine.generate(first, 1)
    for seed in (7, 8, 9):  # other conversations push the first one out of RAM
        await engine.generate(tokens(seed, 40), 1)
    prompt = first + tokens(10, 12)
    peek = await engine.client.lookup(prompt[:-1], lease=False)
    assert (peek.kv_tokens, peek.state_tokens) == (37, 37)
    assert peek.snapshot is not None and peek.snapshot.tier == "disk"
    assert peek.child is not None and peek.child.tier == "disk"

    result = await engine.generate(prompt, NEW)
    assert result.plan == ReusePlan(kv_tokens=37, load_state=True) and result.fallback is None
    assert_exact(model, prompt, result)
    running.store.check()


async def test_reuse_after_a_restart_on_the_same_data_dir(tmp_path: Path, start_store: StartStore,
                                                           make_engine: MakeEngine, model: HybridModel) -> None:
    """(e) the store restarts: everything it serves comes from LMDB."""
    config = store_config(tmp_path)
    first_store = await start_store(config)
    engine = await make_engine(first_store, block_tokens=16, page_tokens=16)
    first = tokens(11, 45)
    await engine.generate(first, 6)  # KV [0, 50) and snapshots at 45 and 50
    await first_store.server.close()

    running = await start_store(config)
    engine = await make_engine(running, block_tokens=16, page_tokens=16)
    prompt = first + tokens(12, 9)
    peek = await engine.client.lookup(prompt[:-1], lease=False)
    assert peek.snapshot is not None and peek.snapshot.tier == "disk"
    result = await engine.generate(prompt, NEW)
    assert (result.kv_tokens, result.state_tokens) == (45, 45)
    assert result.plan == ReusePlan(kv_tokens=45, load_state=True) and result.fallback is None
    assert_exact(model, prompt, result)


async def test_a_conversation_reuses_every_previous_turn(tmp_path: Path, start_store: StartStore,
                                                         make_engine: MakeEngine, model: HybridModel) -> None:
    running = await start_store(store_config(tmp_path))
    engine = await make_engine(running, block_tokens=16, page_tokens=16)
    conversation: list[int] = []
    previous_end = 0
    for turn in range(4):
        conversation += tokens(20 + turn, 23)
        result = await engine.generate(conversation, 7)
        # The previous turn stored prompt + answer up to its generation end (P + N - 1).
        assert result.plan.kv_tokens == previous_end and result.state_tokens == previous_end
        assert_exact(model, conversation, result)
        previous_end = len(conversation) + 7 - 1
        assert result.snapshots == (len(conversation), previous_end)
        conversation += result.generated
    running.store.check()


async def test_tail_replay_of_the_whole_prefix_is_exact_and_a_partial_one_saves_nothing(
        tmp_path: Path, start_store: StartStore, make_engine: MakeEngine, model: HybridModel) -> None:
    running = await start_store(store_config(tmp_path))
    exact = await make_engine(running, block_tokens=16, page_tokens=16)
    first = tokens(30, 60)
    await exact.generate(first, 1)
    prompt = first + tokens(31, 10)

    whole = await make_engine(running, block_tokens=16, page_tokens=16, mode="replay", replay_fraction=1.0)
    result = await whole.generate(prompt, NEW, save=False)
    assert result.plan == ReusePlan(kv_tokens=60, replay_tokens=60) and result.plan.exact
    assert_exact(model, prompt, result)

    partial = await make_engine(running, block_tokens=16, page_tokens=16, mode="replay", replay_tokens=6)
    result = await partial.generate(prompt, NEW)
    assert result.plan == ReusePlan(kv_tokens=60, replay_tokens=6) and not result.plan.exact
    assert result.save is None and result.snapshots == ()  # an approximate state never reaches the store
    after = await partial.client.lookup(prompt + result.generated, lease=False)
    assert (after.kv_tokens, after.state_tokens) == (60, 60)
    reference = recompute_logits(model, prompt)
    assert float((result.logits[0] - reference).abs().max()) > TOL  # approximate, as expected of R < K


async def test_auto_mode_picks_exact_reuse_when_it_recomputes_no_more(
        tmp_path: Path, start_store: StartStore, make_engine: MakeEngine, model: HybridModel) -> None:
    running = await start_store(store_config(tmp_path))
    engine = await make_engine(running, block_tokens=16, page_tokens=16)
    first = tokens(40, 21)
    seeded = await engine.generate(first, 15)  # KV to 35, snapshots at 21 and 35
    onward = first + seeded.generated[:9] + tokens(41, 8)  # agrees with the stored sequence for 30 tokens
    auto = await make_engine(running, block_tokens=16, page_tokens=16, mode="auto", replay_tokens=16)
    result = await auto.generate(onward, NEW, save=False)
    assert (result.kv_tokens, result.state_tokens) == (30, 21)
    assert result.plan == ReusePlan(kv_tokens=21, load_state=True)  # 9 tokens recomputed <= R = 16
    assert_exact(model, onward, result)
    auto = await make_engine(running, block_tokens=16, page_tokens=16, mode="auto", replay_tokens=4)
    result = await auto.generate(onward, NEW, save=False)
    assert result.plan == ReusePlan(kv_tokens=30, replay_tokens=4)  # 9 > R = 4: replay instead


async def test_loads_and_saves_larger_than_the_staging_region_go_in_rounds(
        tmp_path: Path, start_store: StartStore, make_engine: MakeEngine, model: HybridModel) -> None:
    running = await start_store(store_config(tmp_path))
    # The region holds one snapshot (292 KiB): a 600-token prefix is 600 KiB per KV layer to load
    # and 1.2 MiB of payloads to save, so both go in several rounds.
    ns = model.config.namespace(block_tokens=16)
    engine = await make_engine(running, block_tokens=16, page_tokens=6, staging_bytes=ns.state.snapshot_bytes)
    layer_payloads = [16 * ns.kv.layer_token_bytes] * 37 + [8 * ns.kv.layer_token_bytes]
    assert len(engine.staging.rounds(layer_payloads)) == 3
    assert len(engine.staging.rounds([2 * p for p in layer_payloads])) == 5
    first = tokens(80, 600)
    seeded = await engine.generate(first, 1)
    assert seeded.save is not None and seeded.save.stored == 37 + 1 + 1  # blocks, the tail, the snapshot
    prompt = first + tokens(81, 9)
    result = await engine.generate(prompt, NEW)
    assert result.plan == ReusePlan(kv_tokens=600, load_state=True) and result.fallback is None
    assert result.loaded_bytes == ns.kv.payload_bytes(600) + ns.state.snapshot_bytes
    assert_exact(model, prompt, result)
