"""vLLM and SGLang share one cache for one hybrid model (issue 32), through both engines' real classes.

The vLLM side is the connector in tests/vllm/harness.py (vLLM's VllmConfig, KV cache config and
views, its CPU cache kernel writing the blocks) with ``keys: sglang-pages``; the SGLang side is the
HiCache backend over SGLang's own host pools (tests/sglang/engine.py), its Mamba pool shaped by
SGLang's own ``Lfm2Config.mamba2_cache_params``. The model is an LFM2 (attention + short conv) both
describe the same way: its config.json, written here, is what the SGLang backend reads to lay the
state out by channel. Keys come from SGLang's own ``get_storage_hash_str``: vLLM computes the same
chain from the token ids (client/pagekeys.py).

* vLLM saves a prompt (KV and conv state at a page end); SGLang finds it and loads it into its
  host pools: every element what vLLM's blocks held, read through SGLang's ``get_data_page``.
* SGLang backs pages and a state up; vLLM loads them into its blocks: what vLLM's kernel writes
  for those values, byte for byte.
* A conv state of another dtype (SGLang's default, bfloat16, against vLLM's float16) is another
  namespace: nothing is found, no byte moves.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed: tests/sglang/install_sglang.sh installs it")
pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from prefixstore.client.pagekeys import keyed_prompt, page_keys  # noqa: E402

from ..serve_process import ServeProcess  # noqa: E402
from ..vllm.harness import ATTN, CONV_CHANNELS, MAMBA, Engine, random_kv, request  # noqa: E402
from ..vllm.test_cross_tp import conv_state, read_state, write_state  # noqa: E402
from . import engine  # noqa: E402

PAGE = 16  # SGLang's page size = the store's block size = vLLM's block size in the harness
TOKENS = [(i * 29 + 5) % 1000 for i in range(3 * PAGE)]


@pytest.fixture(scope="module", autouse=True)
def _one_process_group() -> Iterator[None]:
    engine.init_dist()
    yield
    engine.close_dist()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An LFM2's config.json: 8 channels of short conv (window 3) beside attention. The SGLang
    backend reads it to lay the state out by channel; no weights are needed."""
    from transformers import Lfm2Config

    path = tmp_path_factory.mktemp("lfm2-config")
    Lfm2Config(vocab_size=1000, hidden_size=CONV_CHANNELS, intermediate_size=16, num_hidden_layers=4,
               num_attention_heads=2, num_key_value_heads=2, layer_types=["conv", "full_attention"] * 2,
               conv_L_cache=4, conv_dim=CONV_CHANNELS, block_dim=CONV_CHANNELS).save_pretrained(path)
    return str(path)


def sglang_pools(conv_dtype: torch.dtype = torch.float16) -> tuple[Any, Any]:
    """SGLang's host pools for the model: MHA pages of 2 layers x 2 heads x 32 dims (float16, the
    harness's), and the Mamba pool SGLang builds from its own Lfm2Config's cache params."""
    from sglang.srt.configs.lfm2 import Lfm2Config
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MambaPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    device = MHATokenToKVPool(size=512, page_size=PAGE, dtype=torch.float16, head_num=2, head_dim=32,
                              layer_num=len(ATTN), device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = engine.host_pool(lambda: get_mha_host_pool_cls(info)(
        info, 2.0, 0, PAGE, "page_first", pin_memory=False, device_capacity_tokens=device.size,
        start_layer=device.start_layer, end_layer=device.end_layer, write_back_staging=device.hicache_write_back_staging))
    config = Lfm2Config(hidden_size=CONV_CHANNELS, conv_L_cache=4, num_hidden_layers=4,
                        layer_types=["conv", "full_attention"] * 2, num_attention_heads=2, num_key_value_heads=2)
    params = config.mamba2_cache_params
    params = Mamba2CacheParams(shape=params.shape, layers=params.layers,
                               dtype=Mamba2StateDType(conv=conv_dtype, temporal=torch.float32))
    pool = MambaPool(size=8, spec_state_size=0, cache_params=params, mamba_layer_ids=list(params.layers), device="cpu")
    (minfo,) = pool.get_device_pool_infos()
    mamba = engine.host_pool(lambda: MambaPoolHost(minfo.buffer_info, 2.0, 0, device_capacity=pool.size,
                                                   pin_memory=False, layout="page_first"))
    return host, mamba


def backend(store: ServeProcess, model_dir: str, host: Any, mamba: Any) -> Any:
    assert store.url is not None
    return engine.backend(store.url, host, mamba, model=model_dir, model_id="cross-engine-lfm2")


def vllm_engine(store: ServeProcess) -> Engine:
    return Engine(store.url, "cross-engine-lfm2", hybrid=True, state="short_conv", keys="sglang-pages")


def page_kv(first_pos: int) -> torch.Tensor:
    """A page as SGLang's page_first host layout holds it, [K|V, token, layer, head, dim], each
    element a function of its coordinates (tests/sglang/engine.py ``value``)."""
    c = torch.arange(2).view(2, 1, 1, 1, 1)
    t = torch.arange(PAGE).view(1, PAGE, 1, 1, 1) + first_pos
    lay = torch.arange(len(ATTN)).view(1, 1, -1, 1, 1)
    h = torch.arange(2).view(1, 1, 1, 2, 1)
    d = torch.arange(32).view(1, 1, 1, 1, 32)
    return engine.value(c, lay, t, h, d).to(torch.float16)


def info(prefix: list[str]) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=prefix)


def test_cross_engine_one_namespace_and_one_chain(store: ServeProcess, model_dir: str) -> None:
    """Both engines name the same namespace for the model and dtype, and key pages the same way:
    vLLM's page keys are SGLang's own ``get_storage_hash_str`` (with and without a cache salt)."""
    from sglang.srt.mem_cache.radix_cache import RadixKey

    host, mamba = sglang_pools()
    b = backend(store, model_dir, host, mamba)
    e = vllm_engine(store)
    try:
        assert e.scheduler.scheduler_side is not None
        assert b.namespace is not None and b.namespace == e.scheduler.scheduler_side.namespace
        assert b.namespace.state.num_heads == CONV_CHANNELS  # the state is addressable per channel
        assert page_keys(TOKENS, PAGE) == get_storage_hash_str(TOKENS, None, page_size=PAGE)
        salted = RadixKey(TOKENS, cache_salt="s1")
        assert page_keys(TOKENS, PAGE, cache_salt="s1") == get_storage_hash_str(salted, None, page_size=PAGE)
    finally:
        b.close()
        e.close()


def test_cross_engine_vllm_saves_sglang_loads(store: ServeProcess, model_dir: str) -> None:
    e = vllm_engine(store)
    try:
        kv = random_kv(seed=71)
        full = {name: conv_state(81 + i) for i, name in enumerate(MAMBA)}
        e.write([3, 7, 9], kv, 0, 48)
        write_state(e, 5, full, 0, 1)  # the running state after 48 tokens: Mamba block (48 - 1) // 16 = 2
        e.finish(request("r1", TOKENS + [1], computed=48), ([3, 7, 9], [0, 0, 5]))
    finally:
        e.close()

    host, mamba = sglang_pools()
    b = backend(store, model_dir, host, mamba)
    try:
        keys = get_storage_hash_str(TOKENS, None, page_size=PAGE)
        found = b.batch_exists_v2(keys, [PoolTransfer(name=PoolName.MAMBA, keys=["-"],
                                                      hit_policy=PoolHitPolicy.TRAILING_PAGES)], info([]))
        assert found.kv_hit_pages == 3 and found.restorable_prefix_pages == [3]
        idx = host.alloc(3 * PAGE)
        assert b.batch_get_v1(keys, idx, info([])) == [True] * 3
        for j in range(3):  # SGLang's own page reader: [layer, K|V, head, token, dim]
            page = engine.read_page(host, int(idx[j * PAGE]))
            want = torch.stack([kv[name][:, j * PAGE : (j + 1) * PAGE].permute(0, 2, 1, 3) for name in ATTN])
            assert torch.equal(page, want), j
        slot = mamba.alloc(1)
        got = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[2]],
                                           hit_policy=PoolHitPolicy.TRAILING_PAGES)], info(keys[:2]))
        assert got == {PoolName.MAMBA: [True]}
        conv = mamba.conv_buffer[0][int(slot[0]), :, 0]  # [mamba layers, channels, window]
        assert torch.equal(conv, torch.stack([full[name] for name in MAMBA]))
        assert b.stats["errors"] == 0
    finally:
        b.close()


def test_cross_engine_sglang_saves_vllm_loads(store: ServeProcess, model_dir: str) -> None:
    tokens = [(i * 31 + 9) % 1000 for i in range(3 * PAGE)]
    host, mamba = sglang_pools()
    b = backend(store, model_dir, host, mamba)
    full = {name: conv_state(91 + i) for i, name in enumerate(MAMBA)}
    try:
        keys = get_storage_hash_str(tokens, None, page_size=PAGE)
        idx = host.alloc(3 * PAGE)
        for j in range(3):  # coordinate-valued pages through SGLang's own setter
            host.set_from_flat_data_page(int(idx[j * PAGE]), page_kv(j * PAGE).flatten())
        slot = mamba.alloc(1)
        conv = mamba.conv_buffer[0]
        conv[int(slot[0]), :, 0] = torch.stack([full[name] for name in MAMBA])
        # SGLang's HybridCacheController backs the side pool up before the KV (the state waits for its page).
        ok = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[keys[2]],
                                          hit_policy=PoolHitPolicy.TRAILING_PAGES)], info(keys[:2]))
        assert ok == {PoolName.MAMBA: [True]}
        assert b.batch_set_v1(keys, idx, info([])) == [True] * 3
        assert b.stats["states_written"] == 1
    finally:
        b.close()

    e = vllm_engine(store)
    try:
        r = request("a", tokens + [1])
        assert e.scheduler.get_num_new_matched_tokens(r, 0) == (48, True)
        e.load(r, 0, 48, ([2, 4, 6], [0, 0, 8]))
        assert e.worker.get_finished(set())[1] == {"a"}
        # What vLLM's kernel writes for the values SGLang held: K/V of layer l, token t, head h.
        pos = torch.arange(3 * PAGE)
        kv = {}
        for li, name in enumerate(ATTN):
            c = torch.arange(2).view(2, 1, 1, 1)
            h = torch.arange(2).view(1, 1, 2, 1)
            d = torch.arange(32).view(1, 1, 1, 32)
            kv[name] = engine.value(c, li, pos.view(1, -1, 1, 1), h, d).to(torch.float16)
        expected = e.expected([2, 4, 6], kv, 48)
        assert all(torch.equal(e.blocks([2, 4, 6])[n].view(torch.uint8), expected[n].view(torch.uint8)) for n in ATTN)
        state = read_state(e, 8, 0, 1)
        assert all(torch.equal(state[name], full[name]) for name in MAMBA)
    finally:
        e.close()


def test_cross_engine_another_dtype_is_another_namespace(store: ServeProcess, model_dir: str) -> None:
    """SGLang's default conv state dtype (bfloat16) against vLLM's float16 here: another
    namespace, so SGLang finds nothing vLLM saved -- never bytes of the other dtype."""
    e = vllm_engine(store)
    try:
        e.write([3, 7, 9], random_kv(seed=72), 0, 48)
        write_state(e, 5, {name: conv_state(101 + i) for i, name in enumerate(MAMBA)}, 0, 1)
        tokens = [(i * 37 + 1) % 1000 for i in range(3 * PAGE)]
        e.finish(request("r1", tokens + [1], computed=48), ([3, 7, 9], [0, 0, 5]))
        vllm_ns = e.scheduler.scheduler_side.namespace  # type: ignore[union-attr]
    finally:
        e.close()
    host, mamba = sglang_pools(conv_dtype=torch.bfloat16)
    b = backend(store, model_dir, host, mamba)
    try:
        assert b.namespace is not None and b.namespace.id != vllm_ns.id
        assert b.namespace.state.tensor_dtypes == ("bfloat16",)
        keys = get_storage_hash_str(tokens, None, page_size=PAGE)
        assert b.batch_exists(keys, info([])) == 0
        # The same keys in vLLM's namespace do hold the pages: only the namespace keeps them apart.
        assert keyed_prompt(vllm_ns, tokens).hashes[:3] != keyed_prompt(b.namespace, tokens).hashes[:3]
    finally:
        b.close()


def test_an_sglang_rank_at_tp_2_keeps_a_namespace_of_its_own(store: ServeProcess, model_dir: str) -> None:
    """SGLang hands each rank's backend only its own heads and no group to gather them over, so a
    rank of a TP=2 SGLang cannot write the shared layout's whole pages: its namespace names the
    rank (never equal to the shared one), and its state stays SGLang's own bytes."""
    import dataclasses

    from sglang.srt.mem_cache.storage import StorageBackendFactory

    assert store.url is not None
    host, mamba = sglang_pools()
    config = dataclasses.replace(engine.storage_config(store.url, model_dir, model_id="cross-engine-lfm2"),
                                 tp_rank=1, tp_size=2)
    b = StorageBackendFactory.create_backend("dynamic", config, host)
    b.register_mem_pool_host(host)
    b.register_mem_host_pool_v2(host, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    shared = backend(store, model_dir, *sglang_pools())
    try:
        assert b.namespace is not None and "|tp:1/2" in b.namespace.revision
        assert b.namespace.id != shared.namespace.id and b.namespace.state.num_heads == 0
    finally:
        b.close()
        shared.close()
