"""The connector's failure paths against vLLM's real classes and a real store (issue 29): every one
ends as a recompute or a dropped save that vLLM accepts, never a held block or an engine assertion.

* a worker that cannot map its views answers every plan, and the scheduler stops planning;
* a save that never finishes is dropped after ``save_timeout_s``, counted and logged;
* a load whose store grew between the scheduler's lookup and the worker's loads what it planned;
* a request that finishes while its load is in flight is not held for a save (vLLM frees its
  blocks when the load is reported; holding them too was the engine core's AssertionError);
* a failed load is recomputed (vLLM's ``kv_load_failure_policy``), and not loaded again.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

import prefixstore.client.vllm.worker as worker_module  # noqa: E402
from prefixstore.client.vllm.layout import LayoutUnsupported  # noqa: E402

from .harness import MAMBA, PROMPT, Engine, hybrid_finished, random_kv, request, same_bytes  # noqa: E402

EngineFactory = Callable[..., Engine]


@pytest.fixture
def silent_url() -> Iterator[str]:
    """A store that accepts connections (the kernel's backlog) and never answers."""
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        yield f"http://127.0.0.1:{silent.getsockname()[1]}"


def blocks_of(*tables: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in ids] for ids in tables))


def test_a_worker_that_cannot_map_its_views_answers_every_plan(engine_factory: EngineFactory,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """What an AMX machine did before the layout was learned: the worker went idle at start-up,
    the scheduler (which cannot see the views) kept planning, and a finished request's blocks and
    the lookups waiting for its save were held for ever."""
    def unmappable(view: torch.Tensor, isa: str | None) -> Any:
        raise LayoutUnsupported("a kernel layout nobody knows")

    monkeypatch.setattr(worker_module, "learn_cpu_layout", unmappable)
    e = engine_factory("refusing", save_wait_s=60)
    assert e.worker.worker_side.refused == "a kernel layout nobody knows"  # type: ignore[union-attr]
    # The scheduler has not heard yet: it plans a save and holds the blocks.
    assert e.scheduler.request_finished_all_groups(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],)) == (True, None)
    e.step()
    sending, _ = e.worker.get_finished({"r1"})
    assert sending == {"r1"}  # the blocks are released in that step
    assert e.scheduler.saves_in_flight == 0  # answered, not forgotten after save_wait_s
    assert e.worker.get_kv_connector_stats().data["saves_dropped"] == 1  # type: ignore[union-attr]
    # Having heard, it plans nothing more: no lookup, no save.
    assert e.scheduler.scheduler_side.refused == "a kernel layout nobody knows"  # type: ignore[union-attr]
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [1]), 0) == (0, False)
    assert e.scheduler.request_finished_all_groups(request("r2", PROMPT + [5], computed=40), ([1, 2, 3],)) == (False, None)


def test_a_load_planned_before_the_refusal_is_reported_failed(engine_factory: EngineFactory,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    e = engine_factory("refusing-load", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=5)  # saved by a worker that maps its views
    monkeypatch.setattr(worker_module, "learn_cpu_layout",
                        lambda view, isa: (_ for _ in ()).throw(LayoutUnsupported("unmappable")))
    refusing = engine_factory("refusing-load", hybrid=True)
    r = request("a", PROMPT + [8] * 10)
    assert refusing.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
    refusing.load(r, 0, 40, ([40, 41, 42], [0, 0, 52]))
    results = refusing.worker.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.failed_recving == {"a"}  # vLLM recomputes it


def test_a_save_that_hangs_is_dropped_after_save_timeout_s(engine_factory: EngineFactory,
                                                            caplog: pytest.LogCaptureFixture) -> None:
    e = engine_factory("hang", save_timeout_s=0.3, save_wait_s=60)
    client = e.worker.worker_side.client  # type: ignore[union-attr]

    async def never_ends(*args: object, **kwargs: object) -> None:
        await asyncio.Event().wait()

    client.save = never_ends  # type: ignore[method-assign]  # a store that takes the offer and never answers
    e.write([3, 7, 9], random_kv(seed=1), 0, 40)
    with caplog.at_level(logging.WARNING, logger="prefixstore.client.vllm.worker"):
        e.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],))  # blocks released once copied
    assert e.scheduler.saves_in_flight == 0  # the worker reported it ended (save_wait_s is a minute)
    assert e.worker.get_kv_connector_stats().data["saves_dropped"] == 1  # type: ignore[union-attr]
    assert "prefixstore save of r1 dropped: not finished after 0.3 s (save_timeout_s)" in caplog.text


def test_a_load_whose_store_grew_meanwhile_loads_what_it_planned(engine_factory: EngineFactory) -> None:
    """Turn k of a conversation was saved to its prompt end (40) by one replica; turn k + 1 arrives
    at another, which plans a load of 40; before its worker reads, the first replica's request-end
    save lands (60 tokens, a state at 60). The load takes the planned 40 and the state at 40."""
    kv = random_kv(seed=5, n=64)
    e = engine_factory("grew", hybrid=True)
    e.write([3, 7, 9], kv, 0, 40)
    g = torch.Generator().manual_seed(6)
    for name in MAMBA:
        e.views[name][[11, 12, 13]] = torch.randint(-128, 127, e.views[name][[11, 12, 13]].shape, generator=g,
                                                    dtype=torch.int8)
    state_at_40 = {name: e.views[name][13].clone() for name in MAMBA}
    e.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9], [11, 12, 13]))

    nxt = request("t2", PROMPT + [8] * 30)
    assert e.scheduler.get_num_new_matched_tokens(nxt, 0) == (40, True)
    other = engine_factory("grew", hybrid=True)  # the other replica
    other.write([1, 2, 3, 4], kv, 0, 60)
    other.finish(request("r0", PROMPT + [8] * 20 + [5], computed=60), ([1, 2, 3, 4], [5, 6, 7, 8]))
    assert other.scheduler.get_num_new_matched_tokens(request("probe", PROMPT + [8] * 30), 0) == (60, True)

    e.load(nxt, 0, 40, ([40, 41, 42], [0, 0, 52]))
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"t2"} and results.failed_recving == set()
    assert same_bytes(e.blocks([40, 41, 42]), e.expected([40, 41, 42], kv, 40))
    for name in MAMBA:
        assert torch.equal(e.views[name][52], state_at_40[name])


def test_a_request_that_finishes_while_its_load_is_in_flight_is_not_held(engine_factory: EngineFactory) -> None:
    """vLLM finishes a request waiting for its remote KV (aborted by its client, or failed) and
    frees its blocks when the load is reported; a save holding them as well made vLLM release a
    request it had already deleted (scheduler.py ``_update_from_kv_xfer_finished``)."""
    e = engine_factory("abort-while-loading", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=15)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
    e.scheduler.update_state_after_alloc(r, blocks_of([40, 41, 42], [0, 0, 52]), 40)
    r.num_computed_tokens = 40
    assert e.scheduler.request_finished_all_groups(r, ([40, 41, 42], [0, 0, 52])) == (False, None)
    e.step()
    results = e.worker.get_transfer_results(set())
    assert results.finished_recving == {"a"} and results.finished_sending == set()
    e.scheduler.update_connector_output(KVConnectorOutput(finished_recving=results.finished_recving))
    # The load reported, the same request id finishing later is saved as usual.
    again = request("a", PROMPT + [5], computed=40)
    assert e.scheduler.request_finished_all_groups(again, ([3, 7, 9], [11, 12, 13])) == (True, None)


def test_a_failed_load_is_recomputed_and_not_loaded_again(engine_factory: EngineFactory) -> None:
    e = engine_factory("recompute", hybrid=True)
    # vLLM's default would end the request with an error; a cache's failed load is a miss.
    assert e.config.kv_transfer_config.kv_load_failure_policy == "recompute"  # type: ignore[union-attr]
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=25)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
    e.scheduler.update_state_after_alloc(r, blocks_of([40, 41, 42], [0, 0, 52]), 40)
    e.scheduler.update_connector_output(KVConnectorOutput(finished_recving={"a"}, failed_recving={"a"}))
    # vLLM resets the request and asks again: the connector answers from the engine alone now.
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)


def test_a_slow_store_is_a_miss_after_lookup_timeout_s(engine_factory: EngineFactory, silent_url: str) -> None:
    """vLLM's scheduler waits for the lookup, and every request of the engine with it: a store
    that takes the connection and never answers is a miss once lookup_timeout_s has passed (the
    client's own timeout_s here is 2 s), counted apart from other failures."""
    e = engine_factory("slow-store", url=silent_url, lookup_timeout_s=0.2)
    r = request("a", PROMPT + [1])
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    e.scheduler.update_state_after_alloc(r, blocks_of([]), 0)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookup_timeouts"] == 1 and stats.data["lookup_failures"] == 1


def busy(e: Engine) -> None:
    """vLLM's step that scheduled tokens: the engine is running requests."""
    from vllm.v1.core.sched.output import SchedulerOutput

    step = SchedulerOutput.make_empty()
    step.total_num_scheduled_tokens = 8
    e.scheduler.build_connector_meta(step)


def ask_until_answered(e: Engine, r: Any, limit_s: float = 5.0) -> tuple[tuple[int | None, bool], int]:
    """vLLM asking again every step (here every 10 ms) until the connector answers; the answer and
    how many times it said "not yet"."""
    import time

    deadline = time.monotonic() + limit_s
    not_yet = 0
    while True:
        answer = e.scheduler.get_num_new_matched_tokens(r, 0)
        if answer[0] is not None or time.monotonic() > deadline:
            return answer, not_yet
        not_yet += 1
        time.sleep(0.01)


def test_a_slow_lookup_does_not_hold_a_busy_engine(engine_factory: EngineFactory, silent_url: str) -> None:
    """While the engine runs requests, a lookup the store does not answer within lookup_block_s
    goes on in the background: vLLM hears "not yet" (None) and runs its step, and asks again; past
    lookup_timeout_s it is a miss. Before, the scheduler (and every running request) waited the
    whole lookup_timeout_s, 8-32 times a run under concurrent load."""
    e = engine_factory("slow-store-busy", url=silent_url,
                       lookup_timeout_s=0.2, lookup_block_s=0.001)
    busy(e)
    r = request("a", PROMPT + [1])
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (None, False)
    answer, not_yet = ask_until_answered(e, r)
    assert answer == (0, False) and not_yet >= 1
    e.scheduler.update_state_after_alloc(r, blocks_of([]), 0)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["lookups_deferred"], stats.data["lookup_timeouts"], stats.data["lookup_failures"]) == (1, 1, 1)


def test_a_busy_engines_lookup_waits_as_long_as_recomputing_would_take(engine_factory: EngineFactory, silent_url: str) -> None:
    """A lookup that holds nobody back is not given up at lookup_timeout_s when recomputing what
    it could bring takes longer (here 100 ms a token: 4 s for these 40 tokens, so the 2 s cap):
    still "not yet" well past lookup_timeout_s, a miss only at the cap. Before, 44 of 96 wide-model
    lookups became misses at 0.25 s and each recomputed about a thousand tokens."""
    import time

    from prefixstore.client.vllm.costs import CostFigures
    from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta
    from prefixstore.client.vllm.scheduler import DEFERRED_LOOKUP_MAX_S

    e = engine_factory("slow-store-costly", url=silent_url,
                       lookup_timeout_s=0.2, lookup_block_s=0.001)
    e.scheduler.update_connector_output(KVConnectorOutput(
        kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=CostFigures(prefill_s_per_token=0.1, step_s=0.01))))
    busy(e)
    r = request("a", PROMPT + [1])
    sent = time.monotonic()
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (None, False)
    time.sleep(0.6)  # three times lookup_timeout_s
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (None, False)
    answer, _ = ask_until_answered(e, r)
    assert answer == (0, False) and time.monotonic() - sent >= DEFERRED_LOOKUP_MAX_S
    e.scheduler.update_state_after_alloc(r, blocks_of([]), 0)
    # A store that let a lookup run out is not given that long again until it answers one:
    # the next request's lookup is a miss at lookup_timeout_s.
    busy(e)
    r2 = request("b", PROMPT + [2])
    assert e.scheduler.get_num_new_matched_tokens(r2, 0) == (None, False)
    time.sleep(0.4)
    busy(e)
    assert e.scheduler.get_num_new_matched_tokens(r2, 0) == (0, False)
    e.scheduler.update_state_after_alloc(r2, blocks_of([]), 0)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups_deferred"], stats.data["lookup_timeouts"]) == (2, 2)


def test_a_step_holds_the_scheduler_for_lookups_once(engine_factory: EngineFactory, silent_url: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM asks every waiting request every step: lookup_block_s is what a busy step may spend on
    all of them together, not on each (64 waiting requests would otherwise add 64 x 3 ms to every
    step). A new step has it again."""
    import prefixstore.client.vllm.scheduler as scheduler_module

    asked: list[float] = []
    original = scheduler_module.wait_for_answer

    def recording(future: Any, timeout_s: float) -> bool:
        asked.append(timeout_s)
        return original(future, timeout_s)

    monkeypatch.setattr(scheduler_module, "wait_for_answer", recording)
    e = engine_factory("slow-store-step", url=silent_url,
                       lookup_timeout_s=5.0, lookup_block_s=0.05)
    busy(e)
    waiting = [request(f"w{i}", PROMPT + [i]) for i in range(3)]
    assert [e.scheduler.get_num_new_matched_tokens(r, 0) for r in waiting] == [(None, False)] * 3
    assert asked[0] == pytest.approx(0.05) and sum(asked) <= 0.05 + 1e-9
    asked.clear()
    busy(e)  # the next step
    assert e.scheduler.get_num_new_matched_tokens(waiting[0], 0) == (None, False)
    assert asked == [pytest.approx(0.05)]


def test_a_pending_lookup_ends_with_its_request(engine_factory: EngineFactory, silent_url: str) -> None:
    """A request that finishes (aborted while it waited, say) takes its unanswered lookup with it;
    one whose lookup was given up is not looked up (and deferred) again when asked again."""
    e = engine_factory("slow-store-end", url=silent_url,
                       lookup_timeout_s=0.2, lookup_block_s=0.001)
    busy(e)
    aborted = request("gone", PROMPT + [3])
    assert e.scheduler.get_num_new_matched_tokens(aborted, 0) == (None, False)
    assert e.scheduler.scheduler_side.lookups_pending == 1  # type: ignore[union-attr]
    e.scheduler.request_finished_all_groups(aborted, ([],))
    assert e.scheduler.scheduler_side.lookups_pending == 0  # type: ignore[union-attr]
    r = request("late", PROMPT + [4])
    answer, _ = ask_until_answered(e, r)
    assert answer == (0, False)
    # It did not fit this step: asked again, the same miss, without another lookup.
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    assert e.scheduler.scheduler_side.lookups_pending == 0  # type: ignore[union-attr]
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups_deferred"], stats.data["lookup_timeouts"]) == (2, 1)


def test_a_lookup_that_raises_is_a_miss_not_an_engine_error(engine_factory: EngineFactory,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever a lookup raises stays in the connector: vLLM's scheduler, which would die of it,
    hears a miss (also a TimeoutError raised by the lookup itself, not "not yet")."""
    from prefixstore.client.client import PrefixClient

    async def raising(self: Any, prompt: Any, lease: bool | None = None) -> Any:
        raise TimeoutError("raised inside the lookup")

    monkeypatch.setattr(PrefixClient, "lookup", raising)
    e = engine_factory("raising-lookup")
    assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [1]), 0) == (0, False)
    busy(e)
    r = request("b", PROMPT + [2])
    answer, _ = ask_until_answered(e, r)
    assert answer == (0, False)
    assert e.scheduler.scheduler_side.lookups_pending == 0  # type: ignore[union-attr]


def test_a_deferred_lookup_is_answered_on_a_later_step(engine_factory: EngineFactory) -> None:
    """The lookup a busy engine did not wait for is the one whose answer comes later: the store's
    hit, loaded, from one lookup (asked again, the request is not looked up again)."""
    e = engine_factory("deferred", hybrid=True, load_policy="always", lookup_block_s=0)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=96)
    busy(e)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (None, False)
    answer, _ = ask_until_answered(e, r)
    assert answer == (40, True)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)  # the request did not fit: asked again
    e.scheduler.update_state_after_alloc(r, blocks_of([20, 21, 22], [0, 0, 23]), 40)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups"], stats.data["lookups_deferred"]) == (1, 1)
    assert stats.data.get("lookup_timeouts", 0) == 0


def test_a_load_that_would_not_beat_recomputing_is_not_made(engine_factory: EngineFactory) -> None:
    """With the engine's figures saying 40 tokens recompute faster than a hybrid load returns (a
    tiny model), the store's hit is not loaded (counted), and with load_policy 'always' it is.
    (A load of all 49 tokens the request lacks would pay, so it is looked up.)"""
    from prefixstore.client.vllm.costs import CostFigures
    from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta

    slow_load = CostFigures(prefill_s_per_token=1e-3, step_s=0.006, load_s_per_token=0, load_fixed_s=0.039)
    for policy, expected in (("when_faster", (0, False)), ("always", (40, True))):
        e = engine_factory(f"costs-{policy}", hybrid=True, load_policy=policy)
        hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=95)
        e.scheduler.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=slow_load)))
        assert e.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [8] * 10), 0) == expected
        stats = e.scheduler.get_kv_connector_stats()
        assert (stats.data["loads_skipped"] if stats is not None else 0) == (1 if policy == "when_faster" else 0)
        if policy == "when_faster":  # the figures the decision used reach the operator, in microseconds
            assert stats is not None
            assert {k: v for k, v in stats.data.items() if k.startswith("cost_us:")} == {
                "cost_us:prefill_per_token": 1000, "cost_us:decode_step": 6000, "cost_us:load_per_token": 0,
                "cost_us:load_fixed": 39000}


def test_figures_that_say_no_load_pays_are_measured_again(engine_factory: EngineFactory) -> None:
    """A hit the figures keep from loading is a figure not measured again: figures made pessimistic
    once (a busy spell, a poor fit) would keep the store unused for good. One such hit in
    REMEASURE_EVERY is loaded anyway (counted), the others are not."""
    from prefixstore.client.vllm.costs import CostFigures
    from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta
    from prefixstore.client.vllm.scheduler import REMEASURE_EVERY

    slow_load = CostFigures(prefill_s_per_token=1e-3, step_s=0.006, load_s_per_token=0, load_fixed_s=0.039)
    fast_load = CostFigures(prefill_s_per_token=1e-3, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)
    e = engine_factory("costs-remeasured", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=98)

    def ask(i: int, figures: CostFigures) -> tuple[int | None, bool]:
        e.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=figures)))
        return e.scheduler.get_num_new_matched_tokens(request(f"a{i}", PROMPT + [8] * 10), 0)

    # A hit that pays in the middle does not start the count again: hits of another size than
    # the ones that pay would otherwise never be measured.
    answers = [ask(i, fast_load if i == 3 else slow_load) for i in range(2 * REMEASURE_EVERY + 1)]
    loaded = [i for i, a in enumerate(answers) if a == (40, True)]
    assert loaded == [3, REMEASURE_EVERY, 2 * REMEASURE_EVERY], answers
    assert all(a == (0, False) for i, a in enumerate(answers) if i not in loaded), answers
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["loads_skipped"], stats.data["loads_remeasured"]) == (2 * REMEASURE_EVERY - 2, 2)


def test_a_load_is_judged_by_what_its_request_waited(engine_factory: EngineFactory,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's figures model a load (2 ms and a 6 ms step: a 40-token hit that takes 40 ms to
    recompute is loaded); the scheduler measures what the load cost its request, from the step
    that planned it to the report that it ended. Loads whose requests waited 100 ms each: once
    there are MIN_WAIT_SAMPLES of them, the next such hit is recomputed (counted), and the
    measured wait reaches the operator beside the modelled figures. Loads planned in one step and
    reported in one report are one sample (one slow step is one sample, not as many as it held);
    a load that failed is none."""
    from prefixstore.client.vllm import scheduler as scheduler_module
    from prefixstore.client.vllm.costs import MIN_WAIT_SAMPLES, CostFigures
    from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta

    clock = [1000.0]
    monkeypatch.setattr(scheduler_module, "wait_clock", lambda: clock[0])
    modelled = CostFigures(prefill_s_per_token=1e-3, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)
    e = engine_factory("costs-waited", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=99)
    e.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=modelled)))
    asked = iter(range(1000))

    def load_in_step(n: int, fail: bool = False) -> None:
        """``n`` hits loaded in one step, reported ended 100 ms later in one report."""
        ids = []
        for _ in range(n):
            r = request(f"a{next(asked)}", PROMPT + [8] * 10)
            assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, True)
            b = 40 + 3 * len(ids)
            e.scheduler.update_state_after_alloc(r, blocks_of([b, b + 1, b + 2], [0, 0, 52]), 40)
            ids.append(r.request_id)
        e.scheduler.build_connector_meta(SchedulerOutput.make_empty())
        clock[0] += 0.100
        e.scheduler.update_connector_output(KVConnectorOutput(
            finished_recving=set(ids), failed_recving=set(ids) if fail else None,
            kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=modelled)))

    load_in_step(3)  # one sample
    load_in_step(1, fail=True)  # none
    for _ in range(MIN_WAIT_SAMPLES - 2):
        load_in_step(1)
    assert e.scheduler.get_num_new_matched_tokens(request("b0", PROMPT + [8] * 10), 0) == (40, True)  # still the model
    e.scheduler.update_state_after_alloc(request("b0", PROMPT + [8] * 10), blocks_of([90, 91, 92], [0, 0, 53]), 40)
    e.scheduler.build_connector_meta(SchedulerOutput.make_empty())
    clock[0] += 0.100
    e.scheduler.update_connector_output(KVConnectorOutput(finished_recving={"b0"}))
    # 40 tokens recompute in 40 ms, their load waits 100: not loaded. (Looked up: a load of all
    # the 109 tokens the request lacks would pay.)
    assert e.scheduler.get_num_new_matched_tokens(request("b1", PROMPT + [8] * 70), 0) == (0, False)
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["loads_skipped"], stats.data["lookups_skipped"]) == (1, 0)
    assert {k: v for k, v in stats.data.items() if k.startswith("cost_us:wait")} == {
        "cost_us:wait_per_token": 0, "cost_us:wait_fixed": 100000}


def test_the_worker_reports_what_its_loads_cost(engine_factory: EngineFactory) -> None:
    """The worker times its finished loads and the scheduler receives the figures with the step's
    report (the load policy decides on them)."""
    e = engine_factory("costs-reported", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=97)
    for i, (computed, tokens) in enumerate(((32, PROMPT[:37] + [999] * 5), (40, PROMPT + [8] * 5))):
        r = request(f"a{i}", tokens)
        assert e.scheduler.get_num_new_matched_tokens(r, 0) == (computed, True)
        e.load(r, 0, computed, ([40, 41], [0, 51]) if computed == 32 else ([40, 41, 42], [0, 0, 52]))
    costs = e.scheduler.scheduler_side.costs  # type: ignore[union-attr]
    assert costs.load_s_per_token is not None and costs.load_fixed_s is not None
    assert costs.prefill_s_per_token is None  # no step computed prompt tokens here: loads go on
