"""Where a token's K and V sit inside a vLLM CPU block, learned from the cache-write kernel
(client/vllm/slot_map.py): the layouts of the kernels on this machine (vec, vec16, and vLLM's AMX
kernel where the CPU has AMX tiles), a modelled AMX-style packing that runs anywhere (tile
pre-packing: pairs of elements interleaved), and kernels whose layout is refused.

Why learned: vLLM's CPU backend picks its kernel by ISA, and on an AMX machine (bfloat16, blocks of
a multiple of 32 tokens) it pre-packs K and V into tile rows; a connector that knew only the vec
layout went idle there and held every save it had planned (issue 29)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed: tests/vllm/install_vllm.sh installs its CPU build")

import torch  # noqa: E402
from torch import Tensor  # noqa: E402

from prefixstore.client.vllm.layout import AttentionLayer, learn_cpu_layout  # noqa: E402
from prefixstore.client.vllm.slot_map import KernelWrite, LayoutUnsupported, cpu_kernel_write, learn_slot_map  # noqa: E402

from .harness import PROMPT, random_kv, request, same_bytes  # noqa: E402


def tile_packed(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
    """A cache write packed the way vLLM's AMX kernel wants its B tiles: per block and head, K as
    ``[d / 2, n, 2]`` (pairs of head-dim elements side by side, for Q.K^T) and V as ``[n / 2, d, 2]``
    (pairs of tokens side by side, for P.V)."""
    _, heads, n, d = key_cache.shape
    j = torch.arange(d)
    for i, slot in enumerate(slots.tolist()):
        b, t = divmod(slot, n)
        for h in range(heads):
            key_cache[b, h].reshape(-1)[((j // 2) * n + t) * 2 + j % 2] = key[i, h]
            value_cache[b, h].reshape(-1)[((t // 2) * d + j) * 2 + t % 2] = value[i, h]


def tile_offsets(n: int, heads: int, d: int) -> tuple[Tensor, Tensor]:
    """Where tile_packed puts K[t, h, j] and V[t, h, j] inside a block ``[heads, 2n, d]``."""
    t = torch.arange(n)[:, None, None]
    h = torch.arange(heads)[None, :, None]
    j = torch.arange(d)[None, None, :]
    base = h * 2 * n * d
    return base + ((j // 2) * n + t) * 2 + j % 2, base + n * d + ((t // 2) * d + j) * 2 + t % 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_tokens", [16, 32])
def test_the_kernels_here_keep_k_transposed_then_v(dtype: torch.dtype, block_tokens: int) -> None:
    """With the vec and vec16 kernels the learned map is the layout the connector once hard-coded:
    per block and head, K^T [d, n] then V [n, d]. On a machine with AMX tiles, vLLM picks its AMX
    kernel for bfloat16 blocks of 32: the learned map is then the tile packing modelled above
    (``tile_offsets``), from vLLM's own kernel."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    heads, d = 2, 32
    slot_map = learn_slot_map(heads, block_tokens, d, dtype, cpu_kernel_write(dtype, block_tokens, d))
    n = block_tokens
    if "amx" in str(_get_attn_isa(dtype, block_tokens, d)):
        # vLLM's AMX kernel (what this machine runs here): not strided, and not quite the packing
        # modelled above (its K tiles hold 16 tokens). What the connector needs of the learned
        # map: every element of the block once, and the kernel's own write read back exactly.
        write = cpu_kernel_write(dtype, block_tokens, d)
        assert slot_map.strided() is None
        offsets = np.concatenate([slot_map.k.ravel(), slot_map.v.ravel()])
        assert np.array_equal(np.sort(offsets), np.arange(2 * heads * n * d))
        key, value = torch.randn(n, heads, d).to(dtype), torch.randn(n, heads, d).to(dtype)
        scratch = torch.zeros(1, heads, n, 2 * d, dtype=dtype)
        key_cache, value_cache = scratch.view(1, heads, 2 * n, d).chunk(2, dim=2)
        write(key, value, key_cache, value_cache, torch.arange(n))
        flat = scratch.view(-1)
        assert torch.equal(flat[torch.from_numpy(slot_map.k)], key)
        assert torch.equal(flat[torch.from_numpy(slot_map.v)], value)
        return
    t = torch.arange(n)[:, None, None]
    h = torch.arange(heads)[None, :, None]
    j = torch.arange(d)[None, None, :]
    assert torch.equal(torch.from_numpy(slot_map.k), h * 2 * n * d + j * n + t)
    assert torch.equal(torch.from_numpy(slot_map.v), h * 2 * n * d + n * d + t * d + j)


def test_a_tile_packed_layout_is_learned_and_moves_bytes_exactly() -> None:
    heads, n, d = 2, 32, 64
    slot_map = learn_slot_map(heads, n, d, torch.bfloat16, tile_packed)
    k, v = tile_offsets(n, heads, d)
    assert torch.equal(torch.from_numpy(slot_map.k), k) and torch.equal(torch.from_numpy(slot_map.v), v)

    # A layer of 6 blocks: the kernel writes 70 tokens over blocks 4, 1, 5; the layer reads them back
    # through the map, writes them elsewhere, and zeroes a range.
    view = torch.zeros(6, heads, n, 2 * d, dtype=torch.bfloat16)
    layer = AttentionLayer(name="l", view=view, block_size=n, token_layout="slot_map", slot_map=slot_map)
    kv = torch.randn(2, 70, heads, d).to(torch.bfloat16)
    key_cache, value_cache = view.view(6, heads, 2 * n, d).chunk(2, dim=2)
    table = [4, 1, 5]
    slots = torch.tensor([table[p // n] * n + p % n for p in range(70)])
    tile_packed(kv[0], kv[1], key_cache, value_cache, slots)
    assert torch.equal(layer.gather(table, 0, 70), kv)
    assert torch.equal(layer.gather(table, 30, 41), kv[:, 30:41])  # across a block boundary
    layer.put(layer.token_index([0, 2, 3], 5, 70), kv[:, 5:])
    assert torch.equal(layer.gather([0, 2, 3], 5, 70), kv[:, 5:])
    layer.zero(table, 33, 40)
    assert not layer.gather(table, 33, 40).any() and torch.equal(layer.gather(table, 40, 70), kv[:, 40:])


def writes_outside(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
    tile_packed(key, value, key_cache, value_cache, slots)
    key_cache[0, 0, 0, 0] = 1  # and one element into another block


def loses_elements(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
    _, heads, n, d = key_cache.shape
    for i, slot in enumerate(slots.tolist()):  # head-dim elements 2k and 2k+1 land in one place
        b, t = divmod(slot, n)
        for h in range(heads):
            key_cache[b, h, t, torch.arange(d) // 2] = key[i, h]
            value_cache[b, h, t] = value[i, h]


def varies_by_block(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
    """Tile-packed in every block but the first, which keeps tokens in rows (a layout that depends
    on where the block is: the probes, which write one block, cannot see it; the round trip can)."""
    n = key_cache.shape[2]
    rest = slots >= n
    tile_packed(key[rest], value[rest], key_cache, value_cache, slots[rest])
    for i in torch.nonzero(~rest).flatten().tolist():
        key_cache[0, :, int(slots[i])] = key[i]
        value_cache[0, :, int(slots[i])] = value[i]


def scales(key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slots: Tensor) -> None:
    tile_packed(key * 2, value, key_cache, value_cache, slots)


@pytest.mark.parametrize(("kernel", "why"), [(writes_outside, "outside the block"), (loses_elements, "once in its block"),
                                            (scales, "unchanged"), (varies_by_block, "disagrees")])
def test_a_layout_that_is_not_a_copy_into_the_slots_block_is_refused(kernel: KernelWrite, why: str) -> None:
    with pytest.raises(LayoutUnsupported, match=why):
        learn_slot_map(2, 32, 64, torch.bfloat16, kernel)


def test_save_and_load_through_a_tile_packed_engine_are_bit_exact(
        engine_factory: Callable[..., object], monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole connector on an engine whose kernel packs tiles (what an AMX machine runs): the
    worker learns the packing from the kernel, saves 40 tokens, and a sibling loads them into other
    blocks exactly as the kernel would have written them."""
    import prefixstore.client.vllm.layout as layout

    monkeypatch.setattr(layout, "cpu_kernel_write", lambda dtype, n, d, isa: tile_packed)
    e = engine_factory("tile-packed", kernel=tile_packed, dtype=torch.bfloat16)
    assert e.worker.worker_side.refused is None  # type: ignore[attr-defined]
    kv = random_kv(seed=1, dtype=torch.bfloat16)
    e.write([3, 7, 9], kv, 0, 40)  # type: ignore[attr-defined]
    e.finish(request("r1", PROMPT + [5], computed=40), ([3, 7, 9],))  # type: ignore[attr-defined]
    r = request("a", PROMPT + [11] * 20)
    assert e.scheduler.get_num_new_matched_tokens(r, 0) == (40, False)  # type: ignore[attr-defined]
    e.load(r, 0, 40, ([20, 21, 22],))  # type: ignore[attr-defined]
    assert e.worker.get_block_ids_with_load_errors() == set()  # type: ignore[attr-defined]
    assert same_bytes(e.blocks([20, 21, 22]), e.expected([20, 21, 22], kv, 40))  # type: ignore[attr-defined]


def test_learn_cpu_layout_reads_the_view_shape() -> None:
    view = torch.zeros(3, 2, 32, 128, dtype=torch.bfloat16)
    slot_map = learn_cpu_layout(view, write=tile_packed)
    assert slot_map.k.shape == (32, 2, 64) and slot_map.block_tokens == 32


def test_buffers_made_in_inference_mode_take_writes_outside_it() -> None:
    """vLLM's engine thread copies saves under torch.inference_mode; the client's loop scatters loads
    outside it. A buffer first made on the engine thread must take the loop's in-place writes (an
    inference tensor refuses them: every load failed so under concurrent load)."""
    from prefixstore.client.vllm.layout import Payload, VllmKV

    view = torch.zeros(8, 2, 32, 128)
    slot_map = learn_cpu_layout(view)
    kv = VllmKV([AttentionLayer(name="l", view=view, block_size=32, token_layout="slot_map", slot_map=slot_map)])
    payloads = [Payload(offset=0, num_tokens=16, token_start=0, token_end=16)]
    region = torch.zeros(16 * kv.layer_token_bytes, dtype=torch.uint8)
    with torch.inference_mode():
        kv.gather_payloads(region, payloads, [[1]])  # the save buffer, made on the "engine thread"
        kv.scratch("load", (1 << 16,))  # and the load buffer too, big enough to be reused: the worst case
    kv.scatter_payloads(region, payloads, 0, 1, [[2]], 0)  # the "client loop": no inference mode


def test_the_save_buffer_pool_keeps_and_finds_buffers_by_identity() -> None:
    """Several saves in flight give back buffers of different sizes; the next saves take the
    smallest that fits (tensors compared by identity: ``==`` on tensors compares elements, and a
    list's remove() raised on every second save under load)."""
    from prefixstore.client.vllm.worker import BufferPool

    pool = BufferPool(keep_bytes=1 << 20)
    cpu = torch.device("cpu")
    a, b, c = pool.take(1000, cpu), pool.take(3000, cpu), pool.take(2000, cpu)
    for buf in (a, b, c):
        pool.give(buf)
    assert pool.kept_bytes == 6000
    d = pool.take(1500, cpu)
    assert d.numel() == 1500 and d.data_ptr() == c.data_ptr()  # the 2,000-byte one
    e = pool.take(2500, cpu)
    assert e.data_ptr() == b.data_ptr() and pool.kept_bytes == 1000
    pool.give(e)
    pool.give(pool.take(900, cpu))
    assert pool.kept_bytes == 4000
    small = BufferPool(keep_bytes=2500)
    for n in (1000, 3000, 2000):
        small.give(torch.empty(n, dtype=torch.uint8))
    assert small.kept_bytes == 0 or small.kept_bytes <= 2500
