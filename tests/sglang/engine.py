"""SGLang's own classes on CPU, built the way its HiCache builds them, for the backend's tests.

* Device pools: ``MHATokenToKVPool`` and ``MambaPool`` (CPU tensors).
* Host pools: ``get_mha_host_pool_cls(info)(info, ratio, size, page_size, layout, ...)`` and
  ``MambaPoolHost(info, ratio, size, ...)`` with the arguments SGLang's
  ``build_kv_host_pool`` / ``build_mamba_host_pool`` pass, except ``pin_memory=False``:
  pinning registers the memory with CUDA (``cudaHostRegister``), which a CPU-only torch
  cannot do.
* The backend: ``StorageBackendFactory.create_backend("dynamic", HiCacheStorageConfig, host)``
  then the registration calls of ``HiCacheController.attach_storage_backend``.
* The controller: SGLang's real ``HiCacheController`` (its prefetch, backup and sync threads)
  over a one-process gloo group.
* Page contents encode their coordinates, so every check is independent of the backend's
  own layout code: ``value(component, layer, position, head, dim)``; ``PAGE_AXES`` names the
  axes of ``get_data_page(flat=False)`` per host layout, read off SGLang's ``init_kv_buffer``.

``python -m tests.sglang.engine write URL OUT.json`` is the writer process of the two-process
tests: it saves a sequence through the controller (KV) and a hybrid sequence through the
backend's v2 calls, as SGLang's HybridCacheController makes them, and prints what it wrote.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

import torch

PAGE = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 8
DTYPE = torch.bfloat16
MODEL = "tiny-sglang"
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

#: Axes of SGLang's ``get_data_page(index, flat=False)`` per host layout (c: K/V, l: layer,
#: t: token in page, h: head, d: dim, p: the one page). The store's payload is "l c h t d" (head-major).
PAGE_AXES = {"layer_first": "clthd", "page_first": "ctlhd", "page_first_direct": "cplthd",
             "page_head": "cphtld"}

MAMBA_LAYERS = (0, 2)

HOST_BUDGET = 1 << 30
"""What the tests' host pools may book (they take a few MiB). SGLang checks a host pool against
the machine's available memory less a 10 GiB reserve, so on a shared machine running other
engines a 0.00 GB pool failed ("Not enough host memory available ... -1.00 GB free"): the tests
book against this budget instead (SGLang's own ``host_memory_budget_scope``)."""


def host_pool(make: Callable[[], Any]) -> Any:
    """``make()`` (a HiCache host pool's constructor) booked against HOST_BUDGET."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    with host_memory_budget_scope(HOST_BUDGET):
        return make()


def value(c: Any, l: Any, pos: Any, h: Any, d: Any) -> Any:
    """A page element as a function of its coordinates; integers in [-125, 125] are exact in bf16."""
    return (c * 7 + l * 13 + pos * 3 + h * 5 + d * 11) % 251 - 125


def coords(axes: str, first_pos: int) -> dict[str, torch.Tensor]:
    """Broadcastable coordinate tensors for a page with the given axis letters."""
    sizes = {"c": 2, "l": LAYERS, "t": PAGE, "h": HEADS, "d": HEAD_DIM, "p": 1}
    out = {}
    for i, a in enumerate(axes):
        shape = [1] * len(axes)
        shape[i] = sizes[a]
        out[a] = torch.arange(sizes[a]).reshape(shape)
    out["pos"] = out["t"] + first_pos
    return out


def page_values(axes: str, first_pos: int) -> torch.Tensor:
    c = coords(axes, first_pos)
    return value(c["c"], c["l"], c["pos"], c["h"], c["d"]).to(DTYPE)


def canonical_page(first_pos: int) -> torch.Tensor:
    """What the store must hold for the page starting at ``first_pos``: [layers, 2, heads, P, dim]."""
    return page_values("lchtd", first_pos)


def state_values(slot_seed: int, shapes: list[tuple[torch.Size, torch.dtype]]) -> list[torch.Tensor]:
    """Per-layer state tensors [layers, *shape] derived from ``slot_seed`` and their coordinates."""
    out = []
    for k, (shape, dtype) in enumerate(shapes):
        n = int(torch.tensor(shape).prod())
        base = torch.arange(len(MAMBA_LAYERS) * n).reshape(len(MAMBA_LAYERS), *shape)
        out.append(((base * 3 + slot_seed * 17 + k * 101) % 241 - 120).to(dtype))
    return out


# ---------------------------------------------------------------- pools and backends


def kv_pools(layout: str, size: int = 512, dtype: torch.dtype = DTYPE) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import get_mha_host_pool_cls

    device = MHATokenToKVPool(size=size, page_size=PAGE, dtype=dtype, head_num=HEADS, head_dim=HEAD_DIM,
                              layer_num=LAYERS, device="cpu", enable_memory_saver=False)
    info = device.get_device_pool_infos()[0].buffer_info
    host = host_pool(lambda: get_mha_host_pool_cls(info)(info, 2.0, 0, PAGE, layout, pin_memory=False,
                                                         device_capacity_tokens=device.size,
                                                         start_layer=device.start_layer, end_layer=device.end_layer,
                                                         write_back_staging=device.hicache_write_back_staging))
    return device, host


def mamba_host_pool(layout: str) -> Any:
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateShape
    from sglang.srt.mem_cache.memory_pool import MambaPool
    from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=32, n_groups=1, num_heads=2, head_dim=4,
                                    state_size=8, conv_kernel=4)
    pool = MambaPool(size=8, spec_state_size=0, cache_params=Mamba2CacheParams(shape=shape, layers=list(MAMBA_LAYERS)),
                     mamba_layer_ids=list(MAMBA_LAYERS), device="cpu")
    (info,) = pool.get_device_pool_infos()
    mamba_layout = "page_first" if layout == "layer_first" else layout  # MambaPoolHost takes page_first*
    if mamba_layout == "page_head":
        mamba_layout = "page_first_direct"
    return host_pool(lambda: MambaPoolHost(info.buffer_info, 2.0, 0, device_capacity=pool.size, pin_memory=False,
                                           layout=mamba_layout))


def extra_config(url: str, **more: object) -> dict[str, object]:
    from prefixstore.client.sglang import BACKEND_CLASS, BACKEND_MODULE

    return {"backend_name": "prefixstore", "module_path": BACKEND_MODULE, "class_name": BACKEND_CLASS,
            "interface_v1": 1, "url": url, "connect_timeout_s": 0.5, "timeout_s": 2.0, **more}


def storage_config(url: str, model: str = MODEL, **more: object) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                model_name=model, extra_config=extra_config(url, **more))


def backend(url: str, host: Any, mamba: Any = None, model: str = MODEL, **more: object) -> Any:
    """Through SGLang's factory, registered as HiCacheController.attach_storage_backend (and the
    HybridCacheController's per-pool registrations) do."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend("dynamic", storage_config(url, model, **more), host)
    b.register_mem_pool_host(host)
    if mamba is not None:
        b.register_mem_host_pool_v2(host, PoolName.KV)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    b.on_host_pools_registered()
    return b


_DIST = threading.Lock()


def init_dist() -> Any:
    """One gloo process group of size 1 and SGLang's parallel widths, once per process."""
    import torch.distributed as dist
    from sglang.srt.runtime_context import get_parallel

    with _DIST:
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            get_parallel().override_permanently(
                tp_size=1, pp_size=1, attn_dcp_size=1, tp_rank=0, pp_rank=0, attn_cp_size=1, attn_cp_rank=0,
                attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, attn_dcp_rank=0)
    return dist.group.WORLD


def close_dist() -> None:
    """Destroy the process group init_dist made (later tests in this process may build their own)."""
    import torch.distributed as dist

    with _DIST:
        if dist.is_initialized():
            dist.destroy_process_group()


def controller(url: str, layout: str, **more: object) -> Any:
    """SGLang's HiCacheController with this backend attached by its own attach_storage_backend."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    group = init_dist()
    device, host = kv_pools(layout)
    alloc = TokenToKVPoolAllocator(size=device.size, dtype=DTYPE, device="cpu", kvcache=device, need_sort=False)
    return HiCacheController(alloc, host, PAGE, group, load_cache_event=threading.Event(), io_backend="direct",
                             storage_backend="dynamic", model_name=MODEL, prefetch_threshold=PAGE,
                             storage_backend_extra_config=extra_config(url, **more))


def fill_pages(host: Any, host_indices: torch.Tensor, first_pos: int) -> None:
    """Write coordinate-valued pages through SGLang's own ``set_from_flat_data_page``."""
    axes = PAGE_AXES[host.layout]
    for j in range(host_indices.numel() // PAGE):
        host.set_from_flat_data_page(int(host_indices[j * PAGE]), page_values(axes, first_pos + j * PAGE).flatten())


def read_page(host: Any, index: int) -> torch.Tensor:
    """A host page through SGLang's own ``get_data_page``, permuted to the store's l c h t d."""
    axes = PAGE_AXES[host.layout]
    page = host.get_data_page(index, flat=False)
    if "p" in axes:
        page = page.squeeze(axes.index("p"))
        axes = axes.replace("p", "")
    return page.permute(*[axes.index(a) for a in "lchtd"])


def mamba_shapes(mamba: Any) -> list[tuple[torch.Size, torch.dtype]]:
    return [(mamba.temporal_buffer.shape[3:], mamba.temporal_buffer.dtype)] + \
        [(c.shape[3:], c.dtype) for c in mamba.conv_buffer]


def fill_state(mamba: Any, slot: int, slot_seed: int) -> list[torch.Tensor]:
    """A state slot through SGLang's ``set_from_flat_data_page`` (temporal, then conv, each all layers)."""
    tensors = state_values(slot_seed, mamba_shapes(mamba))
    flat = torch.cat([t.contiguous().view(torch.uint8).reshape(-1) for t in tensors])
    mamba.set_from_flat_data_page(slot, flat)
    return tensors


def canonical_state(tensors: list[torch.Tensor]) -> torch.Tensor:
    """The store's snapshot: per layer, every tensor's bytes in order."""
    rows = [torch.cat([t[i].contiguous().view(torch.uint8).reshape(-1) for t in tensors])
            for i in range(len(MAMBA_LAYERS))]
    return torch.cat(rows)


# ---------------------------------------------------------------- controller driving (the scheduler's part)


def wait_backup(ctrl: Any, timeout_s: float = 30.0) -> Any:
    return ctrl.ack_backup_queue.get(timeout=timeout_s)


def prefetch(ctrl: Any, tokens: list[int], prefix_keys: list[str] | None = None,
             timeout_s: float = 30.0) -> tuple[Any, torch.Tensor | None]:
    """What HiRadixCache does around a storage prefetch: submit, wait for the synced hit count,
    allocate host pages for it, hand the operation to the I/O thread and wait for its last ack."""
    op = ctrl.prefetch("req", tokens, None, prefix_keys if prefix_keys is not None else [])
    hit = ctrl.prefetch_hit_queue.get(timeout=timeout_s)
    assert hit is op
    if not op.storage_hit_count:
        return op, None
    host_indices = ctrl.mem_pool_host.alloc(op.storage_hit_count)
    op.host_indices = host_indices
    ctrl.prefetch_buffer.put(op)
    completed = 0
    while True:
        try:
            ack = ctrl.ack_prefetch_queue.get(timeout=timeout_s)
        except Empty:
            raise AssertionError("the prefetch never finished") from None
        if ack.completed_tokens is not None:
            completed = max(completed, ack.completed_tokens)
        if getattr(ack, "completed_req", False):
            break
    op.completed_tokens = completed
    return op, host_indices


@dataclass
class Written:
    tokens: list[int]
    keys: list[str]
    hybrid_tokens: list[int]
    hybrid_keys: list[str]
    state_page: int
    state_seed: int


def write(url: str) -> Written:
    """The writer process: a KV sequence through the controller, a hybrid one through the backend."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo, PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    tokens = [(i * 31 + 7) % 1000 for i in range(6 * PAGE)]
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)
    ctrl = controller(url, "page_first")
    host = ctrl.mem_pool_host
    idx = host.alloc(len(tokens))
    fill_pages(host, idx, 0)
    ctrl.write_storage(idx, tokens, keys, [])
    op = wait_backup(ctrl)
    assert op.completed_tokens == len(tokens), op.completed_tokens

    # Hybrid: pages 0-3 in two radix nodes ([0, 2) and [2, 4)), one state at the second node's end.
    h_tokens = [(i * 17 + 3) % 1000 for i in range(4 * PAGE)]
    h_keys = get_storage_hash_str(h_tokens, None, page_size=PAGE)
    _, kv_host = kv_pools("page_first")
    mamba = mamba_host_pool("page_first")
    b = backend(url, kv_host, mamba, model=MODEL + "-hybrid")
    h_idx = kv_host.alloc(len(h_tokens))
    fill_pages(kv_host, h_idx, 0)
    slot = mamba.alloc(1)
    fill_state(mamba, int(slot[0]), slot_seed=5)
    # HybridCacheController._page_backup_with_stable_layout: side pools first, then KV.
    [ok] = b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=slot, keys=[h_keys[3]],
                                        hit_policy=PoolHitPolicy.TRAILING_PAGES)],
                          HiCacheStorageExtraInfo(prefix_keys=h_keys[:3]))[PoolName.MAMBA]
    assert ok
    assert all(b.batch_set_v1(h_keys, h_idx, HiCacheStorageExtraInfo(prefix_keys=[])))
    assert b.stats["states_written"] == 1, b.stats
    return Written(tokens=tokens, keys=keys, hybrid_tokens=h_tokens, hybrid_keys=h_keys, state_page=4, state_seed=5)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != "write":
        sys.exit("usage: python -m tests.sglang.engine write URL OUT.json")
    with open(sys.argv[3], "w") as f:
        json.dump(write(sys.argv[2]).__dict__, f)
    print("written")
