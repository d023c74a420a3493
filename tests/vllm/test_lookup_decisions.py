"""What the scheduler does not ask the store, and what it does not offer it again, against vLLM's
real classes and a real store (issue 29: on two busy replicas of a small model, lookups and saves
that no load would ever use cost the requests beside them their first token):
* a request that no load could pay for (the engine's figures, client/vllm/costs.py) is not looked
  up, and not saved, but one in ``REMEASURE_EVERY`` is, and a prefill instance's hand-off always is;
* a request that looked up and did not load saves from the store's match, not from token 0.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.outputs import KVConnectorOutput  # noqa: E402

from prefixstore.client.vllm.costs import CostFigures  # noqa: E402
from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta  # noqa: E402

from ..serve_process import ServeProcess  # noqa: E402
from .harness import PROMPT, Engine, hybrid_finished, request  # noqa: E402

EngineFactory = Callable[..., Engine]

#: 15 us a token to recompute, 8 ms to load and report: no load under 615 tokens pays.
RECOMPUTE_WINS = CostFigures(prefill_s_per_token=15e-6, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)
#: 1 ms a token to recompute: a load of 40 pays.
LOAD_WINS = CostFigures(prefill_s_per_token=1e-3, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)


def blocks_of(*tables: list[int]) -> KVCacheBlocks:
    return KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in ids] for ids in tables))


def store_lookups(url: str) -> float:
    """The store's own count of the lookups it answered."""
    text = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("prefixstore_lookups_total"))


def figures(e: Engine, costs: CostFigures) -> None:
    e.scheduler.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=costs)))


def test_a_request_no_load_could_pay_for_is_neither_looked_up_nor_saved(engine_factory: EngineFactory,
                                                                        store: ServeProcess) -> None:
    """The store holds this prompt's 40 tokens, but by the engine's figures not even a load of all
    49 tokens the request lacks would beat recomputing them: the lookup could change nothing. It
    is not sent (the store counts none), counted once however often vLLM asks, and the request's
    saves are not made either: the engine that would load them, the next turn's, lacks no more."""
    e = engine_factory("unlooked", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=31)
    figures(e, RECOMPUTE_WINS)
    before = store_lookups(store.url)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)  # it did not fit: asked again
    assert store_lookups(store.url) == before
    e.scheduler.update_state_after_alloc(r, blocks_of([20, 21, 22, 23], [0, 0, 0, 24]), 0)
    r.num_computed_tokens = 49
    assert e.scheduler.request_finished_all_groups(r, ([20, 21, 22, 23], [0, 0, 0, 24])) == (False, None)
    assert e.scheduler.build_connector_meta(SchedulerOutput.make_empty()).saves == []
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["lookups_skipped"], stats.data["lookups"], stats.data["saves_skipped"]) == (1, 0, 1)
    assert stats.data["cost_us:prefill_per_token"] == 15  # what the decision used, for the operator

    # Where a load would pay, the same request is looked up, and its hit loaded.
    figures(e, LOAD_WINS)
    assert e.scheduler.get_num_new_matched_tokens(request("b", PROMPT + [8] * 10), 0) == (40, True)
    assert store_lookups(store.url) == before + 1


def test_a_prefill_instances_hand_off_is_saved_whatever_the_figures_say(engine_factory: EngineFactory) -> None:
    """A request a disaggregation proxy sent with ``do_remote_decode``: its decode instance loads
    what it saved, whatever this engine's figures say (computing the prompt is the prefill's work)."""
    e = engine_factory("unlooked-pd", hybrid=True)
    figures(e, RECOMPUTE_WINS)
    r = request("p", PROMPT + [8] * 10)
    r.kv_transfer_params = {"do_remote_decode": True}
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)  # nothing stored: not worth a lookup
    e.scheduler.update_state_after_alloc(r, blocks_of([20, 21, 22, 23], [0, 0, 0, 24]), 0)
    r.num_computed_tokens = 49
    held, params = e.scheduler.request_finished_all_groups(r, ([20, 21, 22, 23], [0, 0, 0, 24]))
    assert held and params is not None and params["do_remote_prefill"]
    assert [s.req_id for s in e.scheduler.build_connector_meta(SchedulerOutput.make_empty()).saves] == ["p"]
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups_skipped"], stats.data["saves_skipped"]) == (1, 0)


def test_a_request_looked_up_after_all_is_saved(engine_factory: EngineFactory) -> None:
    """Not looked up in a step it did not fit; asked again once vLLM holds its first 40 tokens and
    the figures say a load of the rest would pay, it is looked up (the store's hit adds nothing
    to vLLM's) and, being looked up, saved: from the store's match."""
    e = engine_factory("unlooked-then-looked", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=34)
    figures(e, RECOMPUTE_WINS)
    r = request("a", PROMPT + [8] * 10)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    figures(e, LOAD_WINS)
    assert e.scheduler.get_num_new_matched_tokens(r, 40) == (0, False)
    e.scheduler.update_state_after_alloc(r, blocks_of([20, 21, 22, 23], [0, 0, 0, 24]), 0)
    r.num_computed_tokens = 49
    assert e.scheduler.request_finished_all_groups(r, ([20, 21, 22, 23], [0, 0, 0, 24]))[0]
    (save,) = e.scheduler.build_connector_meta(SchedulerOutput.make_empty()).saves
    assert save.req_id == "a" and save.start > 0
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups"], stats.data["saves_skipped"]) == (1, 0)


def test_one_request_in_remeasure_every_is_looked_up_anyway(engine_factory: EngineFactory) -> None:
    """Figures that say no load pays would, unchecked, keep every request from being looked up, so
    from being loaded and measured again: one in REMEASURE_EVERY is looked up, and its hit loaded."""
    from prefixstore.client.vllm.scheduler import REMEASURE_EVERY

    e = engine_factory("unlooked-remeasured", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=32)
    figures(e, RECOMPUTE_WINS)
    answers = [e.scheduler.get_num_new_matched_tokens(request(f"a{i}", PROMPT + [8] * 10), 0)
               for i in range(2 * REMEASURE_EVERY)]
    assert [i for i, a in enumerate(answers) if a == (40, True)] == [REMEASURE_EVERY - 1, 2 * REMEASURE_EVERY - 1]
    assert all(a == (0, False) for i, a in enumerate(answers) if (i + 1) % REMEASURE_EVERY), answers
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None
    assert (stats.data["lookups_skipped"], stats.data["loads_remeasured"]) == (2 * REMEASURE_EVERY - 2, 2)


def test_a_remeasuring_lookup_that_misses_starts_the_count_again(engine_factory: EngineFactory,
                                                                 store: ServeProcess) -> None:
    """Prompts the store does not hold: one in REMEASURE_EVERY is looked up, and its miss does not
    leave every later request looked up."""
    from prefixstore.client.vllm.scheduler import REMEASURE_EVERY

    e = engine_factory("unlooked-misses", hybrid=True)
    figures(e, RECOMPUTE_WINS)
    before = store_lookups(store.url)
    answers = [e.scheduler.get_num_new_matched_tokens(request(f"m{i}", [900 + i] + PROMPT), 0)
               for i in range(3 * REMEASURE_EVERY)]
    assert all(a == (0, False) for a in answers), answers
    assert store_lookups(store.url) == before + 3
    stats = e.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookups_skipped"] == 3 * REMEASURE_EVERY - 3


def test_a_request_that_loads_nothing_saves_from_the_stores_match(engine_factory: EngineFactory) -> None:
    """vLLM holds the first 40 tokens itself, so the store's hit of them is not loaded; the store
    said it holds the prompt's blocks up to its match, and the request's save starts there, not at
    token 0 (the offer would answer "have" to each, after the worker copied them out of vLLM's
    blocks on the engine's thread)."""
    e = engine_factory("save-from-match", hybrid=True)
    hybrid_finished(e, "r1", [3, 7, 9], [11, 12, 13], seed=33)
    r = request("b", PROMPT + [8] * 30)
    assert e.scheduler.get_num_new_matched_tokens(r, 40) == (0, False)
    e.scheduler.update_state_after_alloc(r, blocks_of([30, 31, 32, 33, 34], [0, 0, 0, 0, 35]), 0)
    r.num_computed_tokens = 69
    assert e.scheduler.request_finished_all_groups(r, ([30, 31, 32, 33, 34], [0, 0, 0, 0, 35]))[0]
    (save,) = e.scheduler.build_connector_meta(SchedulerOutput.make_empty()).saves
    B = e.scheduler.scheduler_side.settings.block_tokens  # type: ignore[union-attr]
    assert save.start == 40 // B * B > 0 and len(save.tokens) == 69
