"""Prefill/decode disaggregation through the store (issue 32), the connector against vLLM's real
classes: a prefill instance (``kv_producer``) saves, its finished request's ``kv_transfer_params``
say what; a decode instance (``kv_consumer``) with another vLLM block size loads it, waiting a
bounded time for the commit, never racing it. The engines' end-to-end runs through vLLM's
OpenAI servers and the proxy flow of vLLM's disaggregation examples are in
tests/vllm/test_disagg_serving.py."""

from __future__ import annotations

import threading
from typing import Any

import pytest

vllm = pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import torch  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # noqa: E402
from vllm.v1.core.kv_cache_utils import KVCacheBlock  # noqa: E402
from vllm.v1.request import Request  # noqa: E402

from prefixstore.client.vllm.scheduler import PD_PARAMS  # noqa: E402

from ..serve_process import ServeProcess  # noqa: E402
from .harness import ATTN, MAMBA, PROMPT, Engine, random_kv, request  # noqa: E402
from .test_cross_tp import conv_state, read_state, write_state  # noqa: E402

PROXY_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                "remote_block_ids": None, "remote_host": None, "remote_port": None}
"""What vLLM's disaggregation proxy (tests/v1/kv_connector/nixl_integration/toy_proxy_server.py)
sends the prefill instance, with max_tokens=1."""


def prefill(store: ServeProcess, closing: list[Engine], model: str, prompt: list[int], *, hybrid: bool, seed: int,
            save: bool = True) -> tuple[Engine, dict[str, object], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A prefill instance (vLLM block size 16) takes the proxy's request: it computes the prompt
    (less its last token on a hybrid model), samples its one token, finishes; its KV and state are
    saved (unless ``save`` is False: the save is planned but never run, as when it is in flight).
    Returns the engine, the finished request's kv_transfer_params, the KV and the conv state."""
    p = Engine(store.url, model, hybrid=hybrid, state="short_conv", role="kv_producer")
    closing.append(p)
    r = request("p1", list(prompt))
    r.kv_transfer_params = dict(PROXY_PARAMS)
    p.scheduler.on_new_request(r)
    computed = r.num_prompt_tokens
    assert computed == len(prompt) - (1 if hybrid else 0)  # a hybrid prefill stops short of the last token
    assert r.max_tokens == (1 if hybrid else 4)  # the proxy asks max_tokens=1; a truncated prompt keeps it
    kv = random_kv(seed=seed)
    full = {name: conv_state(seed + i) for i, name in enumerate(MAMBA)}
    attn = [3, 7, 9]
    p.write(attn, kv, 0, computed)
    mamba = [0, 0, 0]
    if hybrid:
        mamba[(computed - 1) // 16] = 5
        write_state(p, 5, full, 0, 1)
    r.num_computed_tokens = computed
    hold, params = p.scheduler.request_finished_all_groups(r, (attn, mamba) if hybrid else (attn,))
    assert hold and params is not None
    if save:
        p.step()
        p.worker.get_finished({"p1"})
    return p, params, kv, full


def decode(store: ServeProcess, closing: list[Engine], model: str, params: dict[str, Any],
           commit_wait_s: float) -> tuple[Engine, Request]:
    """A hybrid decode instance (vLLM block 32) and the request the proxy sends it with the
    prefill's ``kv_transfer_params``."""
    d = Engine(store.url, model, hybrid=True, state="short_conv", role="kv_consumer", block_size=32,
               commit_wait_s=commit_wait_s)
    closing.append(d)
    r = request("d1", list(PROMPT))
    r.kv_transfer_params = params
    return d, r


@pytest.mark.parametrize("hybrid", [False, True], ids=["plain", "hybrid"])
@pytest.mark.parametrize("length", [40, 23], ids=["mid-block", "under-two-pages"])
def test_disagg_decode_loads_what_the_prefill_saved_into_other_blocks(store: ServeProcess, closing: list[Engine],
                                                                      hybrid: bool, length: int) -> None:
    """The decode instance (vLLM block size 32, the prefill's 16) gets the prompt with the prefill's
    kv_transfer_params: it loads the prompt less its last token -- KV and, on a hybrid model, the
    state after it, the state the prefill left -- into its own blocks, byte for byte what its
    kernel would have written; the rest of its last block is zeroed (it held NaN). A prompt ending
    mid-block (40 tokens: 1.25 of the decode's pages) and one shorter than two of them (23)."""
    prompt = PROMPT[:length]
    model = f"disagg-{hybrid}-{length}"
    p, params, kv, full = prefill(store, closing, model, prompt, hybrid=hybrid, seed=61)
    promise = params[PD_PARAMS]
    assert isinstance(promise, dict) and promise["kv_tokens"] == length - hybrid
    assert promise["state_tokens"] == (length - 1 if hybrid else 0)

    d = Engine(store.url, model, hybrid=hybrid, state="short_conv", role="kv_consumer", block_size=32)
    closing.append(d)
    for name in ATTN:
        d.views[name].fill_(float("nan"))  # what a freed page may hold
    r = request("d1", list(prompt))
    r.kv_transfer_params = params
    # Already committed: no wait, and a plain model's load stays synchronous (layer by layer).
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (length - 1, hybrid)
    state_at = [0, 0]
    state_at[(length - 2) // 32] = 8  # the Mamba block vLLM allocates for a hit of length - 1 tokens
    tables = ([4, 6], state_at) if hybrid else ([4, 6],)
    blocks = KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in ids] for ids in tables))
    d.scheduler.update_state_after_alloc(r, blocks, length - 1)
    d.step()
    if hybrid:
        assert d.worker.get_finished(set())[1] == {"d1"}
    got = {n: d.views[n][[4, 6]].view(torch.uint8) for n in ATTN}
    want = {n: t.view(torch.uint8) for n, t in d.expected([4, 6], kv, length - 1).items()}
    filled = (length - 1) // 32 * 32  # whole blocks, then the last one's tokens ...
    for n in ATTN:
        assert torch.equal(got[n][: filled // 32], want[n][: filled // 32])
    last = d.views[ATTN[0]][[4, 6][filled // 32]]
    assert not torch.isnan(last).any()  # ... and zeros after them, never the page's old NaN
    assert all(torch.equal(got[n][filled // 32], want[n][filled // 32]) for n in ATTN)
    if hybrid:
        state = read_state(d, 8, 0, 1)
        assert all(torch.equal(state[name], full[name]) for name in MAMBA)
    stats = d.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookups"] == 1 and stats.data["commit_waits"] == 0


def test_disagg_decode_waits_for_the_prefill_commit(store: ServeProcess, closing: list[Engine]) -> None:
    """The decode request arrives before the prefill's save is committed (the prefill's response
    returns as its step ends, the save goes on): the lookup finds nothing, the load is planned all
    the same and waits on the worker until the save lands, then loads it; counted."""
    model = "disagg-wait"
    p, params, kv, full = prefill(store, closing, model, PROMPT, hybrid=True, seed=62, save=False)
    d, r = decode(store, closing, model, params, commit_wait_s=60)
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (39, True)  # planned though not stored yet
    blocks = KVCacheBlocks(blocks=([KVCacheBlock(block_id=4), KVCacheBlock(block_id=6)],
                                   [KVCacheBlock(block_id=0), KVCacheBlock(block_id=8)]))
    d.scheduler.update_state_after_alloc(r, blocks, 39)
    loading = threading.Thread(target=d.step)  # the decode's load starts and waits for the commit ...
    loading.start()
    p.step()  # ... which the prefill's save makes
    loading.join(timeout=120)
    assert d.worker.get_finished(set())[1] == {"d1"}
    assert d.worker.get_transfer_results(set()).failed_recving == set()
    assert all(torch.equal(d.views[n][[4, 6]].view(torch.uint8),
                           d.expected([4, 6], kv, 39)[n].view(torch.uint8)) for n in ATTN)
    assert all(torch.equal(read_state(d, 8, 0, 1)[name], full[name]) for name in MAMBA)
    worker = d.worker.get_kv_connector_stats()
    scheduler = d.scheduler.get_kv_connector_stats()
    assert scheduler is not None and scheduler.data["commit_waits"] == 1
    assert worker is not None and worker.data["commit_wait_polls"] >= 1 and worker.data["commit_wait_timeouts"] == 0


def test_disagg_decode_recomputes_when_the_commit_never_comes(store: ServeProcess, closing: list[Engine]) -> None:
    """The prefill's save never lands (dropped, its instance died): past commit_wait_s the load
    fails, vLLM recomputes the request, and the timeout is counted."""
    model = "disagg-never"
    _, params, _, _ = prefill(store, closing, model, PROMPT, hybrid=True, seed=63, save=False)
    d, r = decode(store, closing, model, params, commit_wait_s=0.3)
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (39, True)
    d.load(r, 0, 39, ([4, 6], [0, 8]))
    results = d.worker.get_transfer_results(set())
    assert results.failed_recving == {"d1"}
    assert d.worker.get_kv_connector_stats().data["commit_wait_timeouts"] == 1  # type: ignore[union-attr]


def test_disagg_another_namespace_is_never_waited_on(store: ServeProcess, closing: list[Engine]) -> None:
    """A prefill instance of another namespace (another model_id here; another dtype or block size
    alike): the decode instance does not wait for bytes that can never come, it recomputes."""
    _, params, _, _ = prefill(store, closing, "disagg-ns-a", PROMPT, hybrid=False, seed=64)
    d = Engine(store.url, "disagg-ns-b", role="kv_consumer")
    closing.append(d)
    r = request("d1", list(PROMPT))
    r.kv_transfer_params = params
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (0, False)
    stats = d.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["pd_namespace_mismatches"] == 1 and stats.data["commit_waits"] == 0


def test_disagg_roles_producer_never_loads_consumer_never_saves(store: ServeProcess, closing: list[Engine]) -> None:
    model = "disagg-roles"
    both = Engine(store.url, model)
    closing.append(both)
    both.write([3, 7, 9], random_kv(seed=65), 0, 40)
    both.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],))
    producer = Engine(store.url, model, role="kv_producer")
    consumer = Engine(store.url, model, role="kv_consumer")
    closing.extend([producer, consumer])
    assert producer.scheduler.get_num_new_matched_tokens(request("a", PROMPT + [1]), 0) == (0, False)
    assert consumer.scheduler.get_num_new_matched_tokens(request("b", PROMPT + [1]), 0) == (40, False)
    assert consumer.scheduler.request_finished_all_groups(request("c", [7] * 40, computed=40), ([1, 2, 3],)) == \
        (False, None)


def test_disagg_a_slow_lookup_still_waits_for_the_promise(store: ServeProcess, closing: list[Engine]) -> None:
    """The store is busy taking the prefill's put and the decode's lookup comes back after
    lookup_timeout_s (the scheduler's bound): the promise still stands, the worker waits for the
    commit with its own bound and loads. Before, a timed-out lookup made the decode recompute."""
    model = "disagg-slow-lookup"
    p, params, kv, _ = prefill(store, closing, model, PROMPT, hybrid=True, seed=66)
    d = Engine(store.url, model, hybrid=True, state="short_conv", role="kv_consumer", block_size=32,
               lookup_timeout_s=1e-9)  # every scheduler lookup times out
    closing.append(d)
    r = request("d1", list(PROMPT))
    r.kv_transfer_params = params
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (39, True)
    d.load(r, 0, 39, ([4, 6], [0, 8]))
    assert d.worker.get_finished(set())[1] == {"d1"}
    assert all(torch.equal(d.views[n][[4, 6]].view(torch.uint8),
                           d.expected([4, 6], kv, 39)[n].view(torch.uint8)) for n in ATTN)
    stats = d.scheduler.get_kv_connector_stats()
    assert stats is not None and stats.data["lookup_timeouts"] == 1 and stats.data["commit_waits"] == 1


def test_disagg_a_dead_store_is_not_waited_on(store: ServeProcess, closing: list[Engine]) -> None:
    """With the store down the decode recomputes at once: the worker's first poll fails and the
    wait ends there, however long commit_wait_s is."""
    from .harness import dead_url

    _, params, _, _ = prefill(store, closing, "disagg-dead", PROMPT, hybrid=True, seed=67)
    d = Engine(dead_url(), "disagg-dead", hybrid=True, state="short_conv", role="kv_consumer", block_size=32,
               commit_wait_s=600)
    closing.append(d)
    r = request("d1", list(PROMPT))
    r.kv_transfer_params = params
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (39, True)
    d.load(r, 0, 39, ([4, 6], [0, 8]))
    assert d.worker.get_transfer_results(set()).failed_recving == {"d1"}
    stats = d.worker.get_kv_connector_stats()
    assert stats is not None and stats.data["commit_wait_polls"] == 1 and stats.data["commit_wait_timeouts"] == 0


def test_disagg_a_promise_is_loaded_whatever_the_cost_figures_say(store: ServeProcess, closing: list[Engine]) -> None:
    """load_policy when_faster skips a hybrid load that would not beat recomputing (a tiny
    model's 39 tokens here), but never a prefill instance's promise: computing the prompt is the
    prefill's work, and a decode instance that recomputed it would undo the split."""
    from vllm.v1.outputs import KVConnectorOutput

    from prefixstore.client.vllm.costs import CostFigures
    from prefixstore.client.vllm.plans import PrefixStoreWorkerMeta

    model = "disagg-costs"
    _, params, kv, _ = prefill(store, closing, model, PROMPT, hybrid=True, seed=68)
    d = Engine(store.url, model, hybrid=True, state="short_conv", role="kv_consumer", block_size=32,
               load_policy="when_faster")
    closing.append(d)
    recompute_wins = CostFigures(prefill_s_per_token=15e-6, step_s=0.006, load_s_per_token=2e-6, load_fixed_s=0.002)
    d.scheduler.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=PrefixStoreWorkerMeta(costs=recompute_wins)))
    assert not d.scheduler.scheduler_side.costs.load_pays(39)  # type: ignore[union-attr]
    plain = request("other", list(PROMPT))  # the same hit, no promise: not even looked up
    assert d.scheduler.get_num_new_matched_tokens(plain, 0) == (0, False)
    r = request("d1", list(PROMPT))
    r.kv_transfer_params = params
    assert d.scheduler.get_num_new_matched_tokens(r, 0) == (39, True)
    d.load(r, 0, 39, ([4, 6], [0, 8]))
    assert d.worker.get_transfer_results(set()).failed_recving == set()
    assert all(torch.equal(d.views[n][[4, 6]].view(torch.uint8),
                           d.expected([4, 6], kv, 39)[n].view(torch.uint8)) for n in ATTN)
    stats = d.scheduler.get_kv_connector_stats()
    assert stats is not None and (stats.data["lookups_skipped"], stats.data["loads_skipped"]) == (1, 0)
