"""The connector's test harness: what vLLM builds around a connector (configs, views, both roles)
out of vLLM's real classes, driven step by step against a real store (tests/vllm/test_connector*.py).

Imported only by modules that first skip without vLLM."""

from __future__ import annotations

import socket

import torch
from vllm.config import CacheConfig, KVTransferConfig, ParallelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.sampling_params import SamplingParams
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock, get_kv_cache_config_from_groups, get_kv_cache_groups
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, MambaSpec
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request
from vllm.v1.worker.utils import allocate_kv_cache

from prefixstore.client.vllm.slot_map import KernelWrite, cpu_kernel_write
from prefixstore.client.vllm.tp import TpGroup

BS = 16  # vLLM block size here; the store's block size is 16 too, but a different one is tested below
HEADS = 2  # the model's KV heads (a rank of a TP=2 engine holds one)
CONV_CHANNELS = 8  # the "short_conv" state: 8 channels x a window of 3
ATTN = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
MAMBA = ["model.layers.0.linear_attn", "model.layers.2.linear_attn"]


def dead_url() -> str:
    with socket.socket() as s:  # a port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


class Engine:
    """What vLLM builds around a connector: configs, views, both roles."""

    def __init__(self, url: str | list[str], model_id: str, *, hybrid: bool = False, tensor_parallel_size: int = 1,
                 kernel: KernelWrite | None = None, dtype: torch.dtype = torch.float16, tp: TpGroup | None = None,
                 state: str = "opaque", role: str = "kv_both", block_size: int = 16, **extra: object) -> None:
        """``tensor_parallel_size`` > 1 with ``tp`` (this rank's member of a group joining several
        Engines: tests/vllm/test_cross_tp.py): this Engine is that rank, with its share of the
        model's 2 KV heads and of its state. ``state``: "opaque" (a Mamba2 spec vLLM's config does
        not describe: moved as raw bytes, TP=1 only) or "short_conv" (8 channels x 3, split by
        channel: LFM2's state). ``role``: vLLM's kv_role (kv_producer: a prefill instance,
        kv_consumer: a decode instance); ``block_size``: vLLM's (the store's stays 16)."""
        self.kernel = kernel
        """The cache-write kernel the forward pass uses (default: vLLM's own CPU kernel)."""
        # A busy step waits for a lookup up to its budget (lookup_timeout_s), not the 3 ms a real
        # engine under load spends: a test's steps hold no running requests back, and on a loaded
        # CI machine a lookup may take longer than 3 ms and come back "not yet" (None) where the
        # test asks for its answer. The tests of deferral name lookup_block_s themselves.
        extra.setdefault("lookup_block_s", 1.0)
        BS = block_size
        kt = KVTransferConfig(kv_connector="PrefixStoreConnector", kv_role=role,  # type: ignore[arg-type]
                              kv_connector_module_path="prefixstore.client.vllm.connector",
                              kv_connector_extra_config={"url": url, "model_id": model_id, "timeout_s": 2.0,
                                                         "connect_timeout_s": 0.5, **extra})
        cache = CacheConfig(block_size=BS, mamba_cache_mode="align") if hybrid else CacheConfig(block_size=BS)
        self.config = VllmConfig(kv_transfer_config=kt, cache_config=cache,
                                 parallel_config=ParallelConfig(tensor_parallel_size=tensor_parallel_size))
        self.config.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU at start-up
        specs: dict[str, object] = {
            name: FullAttentionSpec(block_size=BS, num_kv_heads=HEADS // tensor_parallel_size, head_size=32, dtype=dtype)
            for name in ATTN}
        if hybrid and state == "opaque":
            specs.update({name: MambaSpec(block_size=BS, shapes=((4, 3), (2, 8, 8)),
                                          dtypes=(torch.float16, torch.float32), mamba_cache_mode="align")
                          for name in MAMBA})
        elif hybrid:
            from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
            from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum

            shapes = MambaStateShapeCalculator.short_conv_state_shape(tensor_parallel_size, CONV_CHANNELS, 4)
            specs.update({name: MambaSpec(block_size=BS, shapes=shapes, dtypes=(torch.float16,),
                                          mamba_type=MambaAttentionBackendEnum.SHORT_CONV, mamba_cache_mode="align")
                          for name in MAMBA})
        groups = get_kv_cache_groups(self.config, specs)
        self.kv_cache_config: KVCacheConfig = get_kv_cache_config_from_groups(self.config, groups, 64 * 4096 * 4)
        self.views = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), KVCacheLayout.LBHNC,
                                       [g.kv_cache_spec.block_size for g in self.kv_cache_config.kv_cache_groups])
        self.scheduler = KVConnectorFactory.create_connector(self.config, KVConnectorRole.SCHEDULER,
                                                             self.kv_cache_config)
        self.worker = KVConnectorFactory.create_connector(self.config, KVConnectorRole.WORKER, self.kv_cache_config)
        if tp is not None and self.worker.worker_side is not None:
            self.worker.worker_side.tp = tp  # the seam: this rank's group, before it registers
        self.worker.register_kv_caches(self.views)
        self.num_groups = len(self.kv_cache_config.kv_cache_groups)

    def close(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    def write(self, block_ids: list[int], kv: dict[str, torch.Tensor], start: int, end: int,
              views: dict[str, torch.Tensor] | None = None) -> None:
        """Write K/V of tokens [start, end) the way a forward pass does: vLLM's own CPU cache kernel."""
        for name in ATTN:
            write_kv((views or self.views)[name], block_ids, kv[name][:, start:end], start, self.kernel)

    def expected(self, block_ids: list[int], kv: dict[str, torch.Tensor], end: int) -> dict[str, torch.Tensor]:
        """The blocks as the kernel would have filled them with tokens [0, end), from zeros."""
        scratch = {name: torch.zeros_like(self.views[name]) for name in ATTN}
        self.write(block_ids, kv, 0, end, scratch)
        return {name: scratch[name][block_ids] for name in ATTN}

    def blocks(self, block_ids: list[int]) -> dict[str, torch.Tensor]:
        return {name: self.views[name][block_ids] for name in ATTN}

    def step(self) -> None:
        """One engine step of the worker: bind the scheduler's plans, load, save, collect."""
        meta = self.scheduler.build_connector_meta(SchedulerOutput.make_empty())
        self.worker.bind_connector_metadata(meta)
        self.worker.start_load_kv(None)  # type: ignore[arg-type]  # the connector reads no forward context
        for name in ATTN:
            self.worker.wait_for_layer_load(name)
        self.worker.wait_for_save()
        self.worker.drain()
        # What vLLM hands the scheduler from the step's output: the saves that ended.
        self.scheduler.update_connector_output(
            KVConnectorOutput(kv_connector_worker_meta=self.worker.build_connector_worker_meta()))

    def finish(self, request: Request, block_ids: tuple[list[int], ...]) -> None:
        """vLLM finishing a request: the connector keeps its blocks until the worker copied them."""
        assert self.scheduler.request_finished_all_groups(request, block_ids) == (True, None)
        self.step()
        sending, _ = self.worker.get_finished({request.request_id})
        assert sending == {request.request_id}
        self.worker.clear_connector_metadata()

    def load(self, request: Request, local: int, external: int, block_ids: tuple[list[int], ...]) -> None:
        blocks = KVCacheBlocks(blocks=tuple([KVCacheBlock(block_id=b) for b in ids] for ids in block_ids))
        self.scheduler.update_state_after_alloc(request, blocks, external)
        self.step()



def write_kv(view: torch.Tensor, block_ids: list[int], kv: torch.Tensor, start: int,
             kernel: KernelWrite | None = None) -> None:
    """Write K/V as a forward pass does: vLLM's CPU cache kernel (or ``kernel``)."""
    blocks, heads, n, c = view.shape
    key_cache, value_cache = view.view(blocks, heads, 2 * n, c // 2).chunk(2, dim=2)  # as the kernel does
    pos = torch.arange(start, start + kv.shape[1])
    slots = torch.tensor(block_ids)[pos // n] * n + pos % n  # the kernel's blocks: n tokens each
    write = kernel if kernel is not None else cpu_kernel_write(view.dtype, n, c // 2)
    write(kv[0].contiguous(), kv[1].contiguous(), key_cache, value_cache, slots)


def random_kv(seed: int, n: int = 48, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """K and V ``[2, n, heads, 32]`` of every attention layer (all of the model's heads)."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(2, n, HEADS, 32, generator=g).to(dtype) for name in ATTN}


def same_bytes(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(torch.equal(a[k].contiguous().view(torch.uint8), b[k].contiguous().view(torch.uint8)) for k in a)


def request(req_id: str, tokens: list[int], computed: int = 0) -> Request:
    r = Request(req_id, tokens, SamplingParams(max_tokens=4), None)
    r.num_computed_tokens = computed
    return r


PROMPT = [(7 * i + 3) % 1000 for i in range(40)]



def hybrid_finished(e: Engine, req_id: str, attn: list[int], mamba: list[int], seed: int,
                    computed: int = 40, **fields: object) -> tuple[dict[str, torch.Tensor], dict[int, dict[str, torch.Tensor]]]:
    """A hybrid request that computed ``computed`` tokens finishes: vLLM's kernel wrote its KV,
    every Mamba block holds some state. Returns the KV and each Mamba block's state by position."""
    kv = random_kv(seed=seed)
    e.write(attn, kv, 0, computed)
    g = torch.Generator().manual_seed(seed + 1)
    for name in MAMBA:
        e.views[name][mamba] = torch.randint(-128, 127, e.views[name][mamba].shape, generator=g, dtype=torch.int8)
    states = {i: {name: e.views[name][b].clone() for name in MAMBA} for i, b in enumerate(mamba)}
    r = request(req_id, PROMPT + [5], computed=computed)
    for key, value in fields.items():
        setattr(r, key, value)
    e.finish(r, (attn, mamba))
    return kv, states
