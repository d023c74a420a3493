"""The connector against vLLM's real classes (CPU) and a real store process.

vLLM's KVConnectorFactory builds the connector from a real VllmConfig; the KV
cache config and the per-layer views come from vLLM's own grouping and
allocator (the views a worker's register_kv_caches receives); requests are
real ``vllm.v1.request.Request`` objects. Saves and loads go through a real
``prefixstore serve`` subprocess.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import torch  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole, supports_hma  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

from prefixstore.client.vllm.connector import PrefixStoreConnector, PrefixStoreStats  # noqa: E402
from prefixstore.protocol.wire import ItemSpec  # noqa: E402

from ..nixl.conftest import NEEDS_NIXL  # noqa: E402
from ..serve_process import ServeProcess, StartServe  # noqa: E402
from .harness import ATTN, MAMBA, PROMPT, Engine, dead_url, hybrid_finished, random_kv, request, same_bytes  # noqa: E402


def test_factory_builds_both_roles(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("factory")
    assert isinstance(e.scheduler, PrefixStoreConnector) and isinstance(e.worker, PrefixStoreConnector)
    assert e.scheduler.role is KVConnectorRole.SCHEDULER and e.worker.role is KVConnectorRole.WORKER
    assert supports_hma(e.scheduler)  # so vLLM keeps its hybrid KV cache manager on
    assert not e.config.scheduler_config.disable_hybrid_kv_cache_manager


def test_save_then_load_is_bit_exact_and_counts_are_in_tokens(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("plain")
    # A request computed 40 tokens (2.5 blocks) in blocks 3, 7, 9 (vLLM's CPU kernel wrote them);
    # it finishes and is saved.
    kv = random_kv(seed=1)
    e.write([3, 7, 9], kv, 0, 40)
    e.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],))

    s = e.scheduler
    # Block-aligned: shares 32 tokens then diverges.
    assert s.get_num_new_matched_tokens(request("a", PROMPT[:32] + [999] * 20), 0) == (32, False)
    # Mid-block: shares 37 tokens; the stored tail agrees for 5 of its 8 tokens.
    assert s.get_num_new_matched_tokens(request("b", PROMPT[:37] + [999] * 20), 0) == (37, False)
    # Beyond the local hit, in tokens: the engine holds 16 locally (one block).
    assert s.get_num_new_matched_tokens(request("c", PROMPT + [11] * 20), 16) == (24, False)
    # The same prompt again: its last token is always computed.
    assert s.get_num_new_matched_tokens(request("d", PROMPT), 0) == (39, False)
    # Nothing beyond the local hit.
    assert s.get_num_new_matched_tokens(request("e", PROMPT + [1]), 48) == (0, False)
    # Side-effect free: asking twice gives the same answer.
    assert s.get_num_new_matched_tokens(request("b", PROMPT[:37] + [999] * 20), 0) == (37, False)

    # Load into other blocks beside the engine's local hit (16 tokens in block 20): the blocks
    # end up byte for byte as if the kernel had computed all 40 tokens there.
    target = [20, 21, 22, 23]
    e.write(target, kv, 0, 16)  # the local hit
    r = request("c2", PROMPT + [11] * 20)
    assert s.get_num_new_matched_tokens(r, 16) == (24, False)
    e.load(r, 16, 24, (target,))
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert same_bytes(e.blocks(target), e.expected(target, kv, 40))

    stats = s.get_kv_connector_stats()
    assert isinstance(stats, PrefixStoreStats)
    assert stats.data["lookups"] == 1 and stats.data["kv_hit_tokens"] == 24 and stats.data["state_hit_tokens"] == 0
    worker_stats = e.worker.get_kv_connector_stats()
    assert worker_stats is not None and worker_stats.data["loaded_tokens"] == 24
    assert worker_stats.data["saved_items"] == 3  # two blocks and a tail
    merged = PrefixStoreConnector.build_kv_connector_stats(stats.data).aggregate(worker_stats)
    assert merged.reduce()["kv_hit_tokens"] == 24 and not merged.is_empty()


def test_store_block_size_independent_of_vllm_block_size(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("blocks-5", block_tokens=5)
    kv = random_kv(seed=3)
    e.write([1, 2, 3], kv, 0, 40)
    e.finish(request("r1", PROMPT + [5], computed=40), ([1, 2, 3],))
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT[:23] + [999] * 9), 0) == (23, False)
    r = request("b", PROMPT[:23] + [999] * 9)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (23, False)
    e.load(r, 0, 23, ([30, 31],))
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert same_bytes(e.blocks([30, 31]), e.expected([30, 31], kv, 23))


def test_cluster_of_three_nodes(cluster: list[str], engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The seed list in ``url`` makes the client a cluster client: same counts, same bytes."""
    e = engine_factory("cluster", url=cluster)
    assert e.scheduler.settings.client.urls == tuple(cluster)
    kv = random_kv(seed=9)
    e.write([1, 2, 3], kv, 0, 40)
    e.finish(request("r1", PROMPT + [5], computed=40), ([1, 2, 3],))
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT[:37] + [999] * 9), 0) == (37, False)
    r = request("b", PROMPT + [7] * 3)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, False)
    e.load(r, 0, 40, ([30, 31, 32],))
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert same_bytes(e.blocks([30, 31, 32]), e.expected([30, 31, 32], kv, 40))


def test_hybrid_loads_kv_and_state_at_any_token(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("hybrid", hybrid=True)
    assert e.num_groups == 2
    # 40 tokens computed (2.5 of vLLM's 16-token pages): the running state, after exactly 40
    # tokens, is in the Mamba block at position (40 - 1) // 16 = 2; the one on vLLM's grid at 32
    # at position 1. The request-end save offers both, with the KV of all 40 tokens.
    attn, mamba = [3, 7, 9], [11, 12, 13]
    kv, states = hybrid_finished(e, "r1", attn, mamba, seed=5)

    s = e.scheduler
    # Off vLLM's grid, to the token: the whole 40 (async: hybrid loads report per request).
    assert s.get_num_new_matched_tokens(request("a", PROMPT + [8] * 10), 0) == (40, True)
    # KV matches 37 tokens; the largest state at or below: 32.
    assert s.get_num_new_matched_tokens(request("b", PROMPT[:37] + [999] * 10), 0) == (32, True)
    # KV matches 20 tokens but no snapshot at or below 20: nothing is loadable (exact mode).
    assert s.get_num_new_matched_tokens(request("c", PROMPT[:20] + [999] * 10), 0) == (0, False)
    # Beyond a local hit of 32: the last 8 tokens and the state after them.
    assert s.get_num_new_matched_tokens(request("d", PROMPT + [8] * 10), 32) == (8, True)

    r = request("a2", PROMPT + [8] * 10)
    assert s.get_num_new_matched_tokens(r, 0) == (40, True)
    # vLLM allocates the external hit's Mamba block where its kernels read a request's initial
    # state: position (40 - 1) // 16 = 2, the earlier ones null.
    e.load(r, 0, 40, ([40, 41, 42], [0, 0, 52]))
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"a2"} and results.failed_recving == set()
    assert same_bytes(e.blocks([40, 41, 42]), e.expected([40, 41, 42], kv, 40))
    for name in MAMBA:
        assert torch.equal(e.views[name][52], states[2][name])
    assert s.get_kv_connector_stats().data["state_hit_tokens"] == 40  # type: ignore[union-attr]


def test_a_load_zeroes_the_rest_of_its_last_block(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """vLLM zeroes the attention blocks it allocates but not those a connector's asynchronous
    load fills (``skip_zeroing_group_ids``); on a hybrid model such a page may last have held a
    state, whose bytes read as KV can be NaN. The load's last block must hold the loaded tokens
    and zeros after them, never the page's earlier bytes; a local hit before the load stays."""
    e = engine_factory("hybrid-zero", hybrid=True)
    kv, states = hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=45)
    target = [40, 41, 42]
    e.write(target, kv, 0, 16)  # the engine's local hit: one whole block
    for name in ATTN:  # the load's blocks as a freed state left them: NaN everywhere
        e.views[name][target[1:]] = float("nan")
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 16) == (24, True)
    e.load(r, 16, 24, (target, [0, 0, 52]))  # tokens [16, 40): block 42 holds 8 of its 16 slots
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.failed_recving == set()
    assert same_bytes(e.blocks(target), e.expected(target, kv, 40))  # zeros past token 40
    for name in MAMBA:
        assert torch.equal(e.views[name][52], states[2][name])


@pytest.mark.parametrize("staging_bytes", [2048, 6000, 64 << 20])
def test_a_load_in_rounds_from_inside_a_payload(engine_factory, staging_bytes: int) -> None:  # type: ignore[no-untyped-def]
    """A hybrid load reads every layer's KV and the state in one batched read when the staging
    region holds them (64 MiB), in several rounds when it does not (6,000 bytes: two 5-token
    payloads of both layers, 2,560 bytes each, per round, the state in the last), and a layer at a
    time when one payload of every layer is larger than the region (2,048 bytes). The store's
    blocks are 5 tokens, vLLM's 16, and the engine's local hit of 16 ends inside the payload of
    tokens [15, 20): the blocks end up byte for byte as if the kernel had computed all 40."""
    e = engine_factory(f"hybrid-rounds-{staging_bytes}", hybrid=True, block_tokens=5, staging_bytes=staging_bytes)
    kv, states = hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=55)
    target = [40, 41, 42]
    e.write(target, kv, 0, 16)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 16) == (24, True)
    e.load(r, 16, 24, (target, [0, 0, 52]))
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.failed_recving == set()
    assert same_bytes(e.blocks(target), e.expected(target, kv, 40))
    for name in MAMBA:
        assert torch.equal(e.views[name][52], states[2][name])


def test_an_idle_step_waits_for_the_load_in_flight(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """A step that computes nothing (vLLM's loop stepping while a request waits for its remote
    KV) waits for the load in flight, up to idle_wait_s, and reports it in that same step,
    rather than return at once and let the loop spin against the load for the GIL."""
    e = engine_factory("idle-wait", hybrid=True, idle_wait_s=1.0)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=65)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
    e.scheduler.update_state_after_alloc(r, KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in [40, 41, 42]],
                                                                  [KVCacheBlock(block_id=b) for b in [0, 0, 52]])), 40)
    meta = e.scheduler.build_connector_meta(SchedulerOutput.make_empty())  # no token scheduled
    assert meta.idle and len(meta.loads) == 1
    e.worker.bind_connector_metadata(meta)
    e.worker.start_load_kv(None)  # type: ignore[arg-type]
    e.worker.wait_for_save()
    results = e.worker.get_transfer_results(set())
    e.worker.clear_connector_metadata()
    assert results.finished_recving == {"a"} and results.failed_recving == set()


def test_hybrid_grid_state_serves_a_sibling(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("hybrid-grid", hybrid=True)
    _, states = hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=15)
    r = request("b", PROMPT[:37] + [999] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (32, True)
    e.load(r, 0, 32, ([40, 41], [0, 51]))
    assert e.worker.get_transfer_results(set()).failed_recving == set()
    for name in MAMBA:
        assert torch.equal(e.views[name][51], states[1][name])


@pytest.mark.parametrize("field", ["spec_token_ids", "num_output_placeholders"])
def test_no_draft_or_placeholder_state_is_ever_offered(engine_factory, field: str) -> None:  # type: ignore[no-untyped-def]
    """A request finishing with draft tokens proposed (speculative decoding: its decode-phase
    Mamba blocks hold draft states until the next step picks the accepted one) or with a step in
    flight (async scheduling): its KV of the accepted tokens is saved, its running state is not;
    only the state vLLM kept on its grid (32) is."""
    e = engine_factory(f"spec-{field}", hybrid=True)
    value: object = [77, 78] if field == "spec_token_ids" else 1
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=25, **{field: value})
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [8] * 10), 0) == (32, True)
    assert e.scheduler.get_kv_connector_stats().data["snapshots_withheld"] == 1  # type: ignore[union-attr]


def test_speculative_engine_offers_no_decode_phase_state(store: ServeProcess) -> None:
    """With a speculative config (n-gram proposer), no request-end state and no decode-phase grid
    state is offered at all, whatever the request's fields say."""
    e = Engine(store.url, "spec-engine", hybrid=True)
    try:
        # What a SpeculativeConfig (n-gram proposer, num_speculative_tokens > 0) sets at start-up;
        # building one here needs a target model config this harness has no model for.
        e.scheduler.scheduler_side.speculative = True
        _, _ = hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=35)
        # The request-end save carries the KV of all 40 tokens, no state: nothing loadable.
        assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [8] * 10), 0) == (0, False)
    finally:
        e.close()


def test_junction_hint_ends_a_chunk_where_vllm_can(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """checkpoint_hint: the store holds KV past its last state; a sibling prompt sets vLLM's
    shared_prefix_boundary to the junction when vLLM's block-floored split lands on it (32: on
    its 16-token grid), and does not where it cannot (37)."""
    e = engine_factory("junction", hybrid=True)
    kv = random_kv(seed=45)
    e.write([3, 7, 9], kv, 0, 40)
    # Only the running state at 40 survives (vLLM nulled the grid one).
    e.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9], [0, 0, 13]))
    on_grid = request("a", PROMPT[:32] + [999] * 20)
    assert e.scheduler.get_num_new_matched_tokens(on_grid, 0) == (0, False)
    assert on_grid.shared_prefix_boundary == 32
    off_grid = request("b", PROMPT[:37] + [999] * 20)
    assert e.scheduler.get_num_new_matched_tokens(off_grid, 0) == (0, False)
    assert off_grid.shared_prefix_boundary == 0
    assert e.scheduler.get_kv_connector_stats().data["junctions_off_grid"] == 1  # type: ignore[union-attr]


def test_lookup_waits_for_a_save_in_flight(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The next turn arrives as the previous one finishes: its lookup is asked again (None) until
    the workers report the previous turn's save ended, then it gets the whole turn."""
    e = engine_factory("wait")
    e.write([3, 7, 9], random_kv(seed=65), 0, 40)
    assert e.scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],)) == (True, None)
    assert e.scheduler.saves_in_flight == 1 and e.scheduler.has_pending_push_work()
    nxt = PROMPT + [5, 6, 7]
    assert e.scheduler.get_num_new_matched_tokens(request("t2", nxt), 0) == (None, False)
    # Another conversation (its own salt) is not held back.
    other = request("o", nxt)
    other.cache_salt = "other"
    assert e.scheduler.get_num_new_matched_tokens(other, 0) == (0, False)
    e.step()  # the worker copies and offers; its report reaches the scheduler
    assert e.scheduler.saves_in_flight == 0 and not e.scheduler.has_pending_push_work()
    assert e.scheduler.get_num_new_matched_tokens(request("t2", nxt), 0) == (40, False)
    assert e.scheduler.get_kv_connector_stats().data["save_waits"] == 1  # type: ignore[union-attr]


def test_a_save_in_flight_that_adds_less_than_a_block_is_not_waited_on(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """The engine holds 32 of the 40 tokens a save in flight would give (two of its 16-token
    blocks): waiting a step for 8 more is not worth it, the lookup answers now."""
    e = engine_factory("no-wait")
    e.write([3, 7, 9], random_kv(seed=66), 0, 40)
    assert e.scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],)) == (True, None)
    assert e.scheduler.get_num_new_matched_tokens(request("t2", PROMPT + [5, 6, 7]), 32) == (0, False)
    assert e.scheduler.get_num_new_matched_tokens(request("t3", PROMPT + [5, 6, 7]), 16) == (None, False)
    e.step()


def test_a_save_wait_ends_once_it_costs_more_than_the_load_gains(engine_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A lookup waits for a save in flight no longer, in all, than loading what the save adds would
    gain against recomputing it (the engine's measured figures): the save adds 24 tokens beyond
    the engine's 16, at 10 ms a token to recompute and 1 ms to load, with 20 ms fixed and a 100 ms
    step: 24 * 9 ms - 120 ms = 96 ms of waiting, then the lookup answers what the store holds."""
    from prefixstore.client.vllm import scheduler as scheduler_module
    from prefixstore.client.vllm.costs import CostFigures

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module.time, "monotonic", lambda: clock[0])
    e = engine_factory("wait-bounded")
    e.write([3, 7, 9], random_kv(seed=67), 0, 40)
    assert e.scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],)) == (True, None)
    e.scheduler.scheduler_side.costs = CostFigures(prefill_s_per_token=0.010, step_s=0.100, load_s_per_token=0.001, load_fixed_s=0.020)
    nxt = PROMPT + [5, 6, 7]
    assert e.scheduler.get_num_new_matched_tokens(request("t2", nxt), 16) == (None, False)
    clock[0] += 0.090
    assert e.scheduler.get_num_new_matched_tokens(request("t2", nxt), 16) == (None, False)
    clock[0] += 0.010  # 100 ms waited: more than the 96 ms the load gains
    assert e.scheduler.get_num_new_matched_tokens(request("t2", nxt), 16) == (0, False)  # the save has not ended
    stats = e.scheduler.get_kv_connector_stats().data  # type: ignore[union-attr]
    assert stats["save_waits"] == 2 and stats["save_waits_ended"] == 1
    # A load that would not gain at all is never waited for.
    e.scheduler.scheduler_side.costs = CostFigures(prefill_s_per_token=0.001, step_s=0.100, load_s_per_token=0.001, load_fixed_s=0.020)
    assert e.scheduler.get_num_new_matched_tokens(request("t3", nxt), 16) == (0, False)
    e.step()


def test_hybrid_refuses_replay_mode(store: ServeProcess) -> None:
    with pytest.raises(ValueError, match="mode: 'replay'"):
        Engine(store.url, "hybrid-replay", hybrid=True, mode="replay")


def test_dead_store_is_zero_tokens_and_no_exception(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("dead", url=dead_url())
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [1]), 0) == (0, False)
    e.scheduler.update_state_after_alloc(request("a", PROMPT + [1]), KVCacheBlocks(blocks=([],)), 0)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookup_failures"] == 1
    # A save against the dead store is dropped; the engine still gets its blocks back.
    e.write([1, 2, 3], random_kv(seed=7), 0, 40)
    e.finish(request("r1", PROMPT + [5], computed=40), ([1, 2, 3],))
    assert e.worker.get_kv_connector_stats().data["dropped_items"] >= 1  # type: ignore[union-attr]


def test_failed_load_reports_blocks_for_recompute(serve: StartServe, tmp_path: Path,
                                                  engine_factory) -> None:  # type: ignore[no-untyped-def]
    doomed = serve("--port", "0", "--data-dir", "none")
    e = engine_factory("doomed", url=doomed.url)
    e.write([1, 2, 3], random_kv(seed=8), 0, 40)
    e.finish(request("r1", PROMPT + [5], computed=40), ([1, 2, 3],))
    r = request("a", PROMPT + [9] * 5)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, False)
    doomed.kill()  # the store dies between the lookup and the load
    e.load(r, 0, 40, ([4, 5, 6],))
    assert e.worker.get_block_ids_with_load_errors() == {4, 5, 6}
    assert e.worker.get_block_ids_with_load_errors() == set()  # reported once
    assert e.worker.get_kv_connector_stats().data["load_failures"] == 1  # type: ignore[union-attr]


def test_unkeyable_requests_are_neither_loaded_nor_saved(engine_factory) -> None:  # type: ignore[no-untyped-def]
    e = engine_factory("lora")
    r = request("a", PROMPT + [1], computed=40)
    r.lora_request = object()  # type: ignore[assignment]  # any adapter: its KV differs from the base model's
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    assert e.scheduler.request_finished_all_groups(r, ([1, 2, 3],)) == (False, None)


def test_prometheus_counters(engine_factory) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    registry = CollectorRegistry()

    def counter(*args: object, **kw: object) -> Counter:
        return Counter(*args, registry=registry, **kw)  # type: ignore[misc,arg-type]

    def gauge(*args: object, **kw: object) -> Gauge:
        return Gauge(*args, registry=registry, **kw)  # type: ignore[misc,arg-type]

    e = engine_factory("prom")
    prom = PrefixStoreConnector.build_prom_metrics(e.config, {Gauge: gauge, Counter: counter, Histogram: Histogram},
                                                   ["model_name", "engine"], {0: ["m", "0"]})
    assert prom is not None
    prom.observe({"query_tokens": 100, "kv_hit_tokens": 60, "state_hit_tokens": 20, "lookups": 2,
                  "cost_us:prefill_per_token": 15, "cost_us:load_fixed": 2000, "cost_us:wait_fixed": 25000}, 0)
    assert registry.get_sample_value("prefixstore_vllm_cost_seconds",
                                     {"model_name": "m", "engine": "0", "figure": "prefill_per_token"}) == 15e-6
    assert registry.get_sample_value("prefixstore_vllm_cost_seconds",
                                     {"model_name": "m", "engine": "0", "figure": "load_fixed"}) == 2e-3
    assert registry.get_sample_value("prefixstore_vllm_cost_seconds",
                                     {"model_name": "m", "engine": "0", "figure": "wait_fixed"}) == 25e-3
    value = registry.get_sample_value
    labels = {"model_name": "m", "engine": "0"}
    assert value("prefixstore_vllm_lookup_tokens_total", {**labels, "kind": "kv", "result": "hit"}) == 60
    assert value("prefixstore_vllm_lookup_tokens_total", {**labels, "kind": "state", "result": "miss"}) == 80
    assert value("prefixstore_vllm_events_total", {**labels, "event": "lookups"}) == 2



def test_a_second_engine_in_the_process_registers_its_counters_again(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """vLLM builds the connector's Prometheus metrics once per engine, in prometheus_client's
    default registry (stats on: ``LLM(disable_log_stats=False)``, ``vllm serve``). A second engine
    in one process (a notebook re-creating ``LLM``, a benchmark's next run) must start, and its
    counters be the ones exported."""
    from prometheus_client import REGISTRY, Counter, Gauge, Histogram

    e = engine_factory("prom-twice")
    types = {Gauge: Gauge, Counter: Counter, Histogram: Histogram}
    PrefixStoreConnector.build_prom_metrics(e.config, types, ["model_name", "engine"], {0: ["first", "0"]})
    second = PrefixStoreConnector.build_prom_metrics(e.config, types, ["model_name", "engine"], {0: ["second", "0"]})
    assert second is not None
    second.observe({"lookups": 3}, 0)
    assert REGISTRY.get_sample_value("prefixstore_vllm_events_total",
                                     {"model_name": "second", "engine": "0", "event": "lookups"}) == 3
    assert REGISTRY.get_sample_value("prefixstore_vllm_events_total",
                                     {"model_name": "first", "engine": "0", "event": "lookups"}) is None

@NEEDS_NIXL
def test_save_then_load_over_nixl_into_the_registered_staging_region(
        serve: StartServe, tmp_path: Path, engine_factory) -> None:  # type: ignore[no-untyped-def]
    nixl_store = serve("--port", "0", "--data-dir", "none", "--state-admission", "always", "--nixl", "on")
    e = engine_factory("nixl", url=nixl_store.url, data_path="nixl", small_save_bytes=0)  # the save over NIXL too
    kv = random_kv(seed=7)
    e.write([3, 7, 9], kv, 0, 40)
    e.finish(request("n1", PROMPT + [5], computed=40), ([3, 7, 9],))
    r = request("n2", PROMPT + [11] * 20)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, False)
    target = [30, 31, 32]
    e.load(r, 0, 40, (target,))
    assert e.worker.get_block_ids_with_load_errors() == set()
    assert same_bytes(e.blocks(target), e.expected(target, kv, 40))
    client = e.worker.worker_side.client
    assert client.data_path == "nixl" and client.path_bytes["nixl"] > 0 and client.path_bytes["http"] == 0
    assert client.failures.total() == 0
    # The staging region was registered once (register_kv_caches), so loads needed no per-call registration.
    host = e.worker.worker_side.staging.host.numpy()
    assert client.impl.data.channel.path.covers(host.ctypes.data, host.ctypes.data + host.nbytes)


@NEEDS_NIXL
def test_the_worker_sets_its_nixl_path_up_as_the_engine_starts(
        serve: StartServe, engine_factory) -> None:  # type: ignore[no-untyped-def]
    nixl_store = serve("--port", "0", "--data-dir", "none", "--nixl", "on")
    e = engine_factory("prepared", url=nixl_store.url)  # data_path auto, as docs/vllm.md configures it
    client = e.worker.worker_side.client
    deadline = time.monotonic() + 30
    while client.data_path != "nixl" and time.monotonic() < deadline:  # set up in the background
        time.sleep(0.01)
    # Before any save or load: the agent is made and the store's loaded, so the engine's first
    # transfer neither waits for it nor has its forward passes stalled while it is made.
    assert client.data_path == "nixl"
    assert client.path_bytes["nixl"] == 0 and client.path_bytes["http"] == 0
    host = e.worker.worker_side.staging.host.numpy()
    assert client.impl.data.channel.path.covers(host.ctypes.data, host.ctypes.data + host.nbytes)


class BlockTable:
    """What vLLM's KV cache manager answers the connector for a running request: its blocks."""

    block_pool = None  # the connector tracks no per-block state in vLLM's pool

    def __init__(self, block_ids: dict[str, tuple[list[int], ...]]) -> None:
        self.block_ids = block_ids

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return self.block_ids[req_id]


def saved_specs(monkeypatch: pytest.MonkeyPatch) -> list[list[ItemSpec]]:
    """Records the items of every save a node client makes from now on, one list per save: what it
    offers, or, where it sends no offer (a small save's one HTTP put, a NIXL save's reserve:
    client/node.py ``NodeClient.save``), what its put carries."""
    from prefixstore.client import node

    made = node.save_items
    saves: list[list[ItemSpec]] = []

    def recording(*args, **kwargs):  # type: ignore[no-untyped-def]
        items = made(*args, **kwargs)
        saves.append([it.spec for it in items])
        return items

    monkeypatch.setattr(node, "save_items", recording)
    return saves


def offered_states(e: Engine, monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Records (boundary, origin) of every snapshot the worker's client sends the store from now on."""
    from prefixstore.protocol.keys import Kind

    saves = saved_specs(monkeypatch)

    class Seen(list):  # type: ignore[type-arg]
        """The snapshots of the saves recorded so far; clear() forgets them."""

        def __eq__(self, other: object) -> bool:
            return [(i.boundary, i.origin) for save in saves for i in save if i.kind is Kind.STATE] == other

        def clear(self) -> None:
            saves.clear()

    return Seen()


def test_snapshots_are_offered_with_their_origin(engine_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Each snapshot says why it was taken, so the store's adaptive admission can tell prompt ends
    (seldom reused in multi-turn chat) from generation ends (the next turn's start): the prefill
    step of a 40-token prompt offers the prompt end (40) and vLLM's grid state below it (32,
    periodic); the request end after 8 sampled tokens offers the generation end (47)."""
    from vllm.v1.core.sched.output import NewRequestData

    from prefixstore.protocol.keys import Origin

    e = engine_factory("origins", hybrid=True)
    seen = offered_states(e, monkeypatch)
    blocks = ([3, 7, 9], [11, 12, 13])
    e.scheduler.bind_kv_cache_manager(BlockTable({"r": blocks}))  # type: ignore[arg-type]
    r = request("r", PROMPT)
    e.scheduler.on_new_request(r)
    e.write(blocks[0], random_kv(seed=75), 0, 40)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData.from_request(r, blocks)]
    step.num_scheduled_tokens = {"r": 40}
    e.worker.bind_connector_metadata(e.scheduler.build_connector_meta(step))  # the step computing the prompt
    e.worker.wait_for_save()
    e.worker.drain()
    e.worker.clear_connector_metadata()
    assert seen == [(32, Origin.PERIODIC), (40, Origin.PROMPT_END)]

    seen.clear()
    r.append_output_token_ids(list(range(8)))
    r.num_computed_tokens = 47  # 8 sampled, all but the last fed through the model
    e.write(blocks[0], random_kv(seed=76), 40, 47)
    e.finish(r, blocks)
    assert seen == [(32, Origin.PERIODIC), (47, Origin.GENERATION_END)]
    # The store kept them: the next turn resumes at the generation end.
    assert e.scheduler.get_num_new_matched_tokens(request("t2", list(r.all_token_ids) + [9, 9]), 0) == (47, True)


def test_an_async_load_into_host_memory_starts_before_the_forward_pass(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """On the CPU a hybrid load starts when vLLM binds the step's plans, before its forward pass
    (vLLM 0.32 calls start_load_kv after it), so it runs beside this step's forward pass and its
    request can be scheduled a step earlier."""
    e = engine_factory("early-load", hybrid=True)
    kv, states = hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=75)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
    e.scheduler.update_state_after_alloc(r, KVCacheBlocks(blocks=([KVCacheBlock(block_id=b) for b in [40, 41, 42]],
                                                                  [KVCacheBlock(block_id=b) for b in [0, 0, 52]])), 40)
    e.worker.bind_connector_metadata(e.scheduler.build_connector_meta(SchedulerOutput.make_empty()))
    e.worker.drain()  # no start_load_kv: the load ran from the bind alone
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.failed_recving == set()
    e.worker.start_load_kv(None)  # type: ignore[arg-type]  # vLLM's call after the forward: no second load
    e.worker.drain()
    assert e.worker.get_transfer_results(set()).finished_recving == set()
    e.worker.clear_connector_metadata()
    assert same_bytes(e.blocks([40, 41, 42]), e.expected([40, 41, 42], kv, 40))
    for name in MAMBA:
        assert torch.equal(e.views[name][52], states[2][name])


def test_a_request_end_save_copies_only_what_its_prompt_end_save_did_not(engine_factory, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A turn's prompt-end save copied its 40-token prompt (blocks 0 and 1 of the store's 16, a
    tail of 8); its request-end save, after 8 sampled tokens, copies from the store block the
    prompt ended in (32) on: one tail of 15 tokens, not the prompt's blocks again (the engine's
    step waits for every copy)."""
    from vllm.v1.core.sched.output import NewRequestData

    from prefixstore.protocol.keys import Kind

    e = engine_factory("copy-once", hybrid=True)
    saves = saved_specs(monkeypatch)
    blocks = ([3, 7, 9], [11, 12, 13])
    e.scheduler.bind_kv_cache_manager(BlockTable({"r": blocks}))  # type: ignore[arg-type]
    r = request("r", PROMPT)
    e.scheduler.on_new_request(r)
    e.write(blocks[0], random_kv(seed=85), 0, 40)
    step = SchedulerOutput.make_empty()
    step.scheduled_new_reqs = [NewRequestData.from_request(r, blocks)]
    step.num_scheduled_tokens = {"r": 40}
    e.worker.bind_connector_metadata(e.scheduler.build_connector_meta(step))
    e.worker.wait_for_save()
    e.worker.drain()
    e.worker.clear_connector_metadata()
    r.append_output_token_ids(list(range(8)))
    r.num_computed_tokens = 47
    e.write(blocks[0], random_kv(seed=86), 40, 47)
    e.finish(r, blocks)
    assert [sum(1 for i in save if i.kind is not Kind.STATE) for save in saves] == [3, 1]
    # Both saves together hold the whole turn: 47 tokens and the state after them.
    assert e.scheduler.get_num_new_matched_tokens(request("t2", PROMPT + list(range(8)) + [5, 6]), 0) == (47, True)


def test_switch_interval_is_set_for_the_worker_process_only_when_asked(engine_factory) -> None:  # type: ignore[no-untyped-def]
    """switch_interval_s > 0 sets the worker process's switch interval when the KV caches are
    registered (the GIL hand-offs to the connector's loads); 0, the default, leaves Python's."""
    import sys

    before = sys.getswitchinterval()
    try:
        engine_factory("switch-default")
        assert sys.getswitchinterval() == before
        engine_factory("switch-set", switch_interval_s=0.0005)
        assert sys.getswitchinterval() == pytest.approx(0.0005)
    finally:
        sys.setswitchinterval(before)
