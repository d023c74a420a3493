"""vLLM's paged KV (and Mamba state) tensors <-> store payloads.

vLLM 0.32 hands a connector one 4-D view per layer (``register_kv_caches``),
whatever the physical layout (``vllm/v1/kv_cache_layout.py``)::

    attention layer:  [kernel_blocks, kv_heads, kernel_block_tokens, head_size + head_size_v]   (K ++ V)
    mamba layer:      [blocks, heads, states, state_bytes]                                      (int8)

Inside a block, where a token's K and V sit is the attention backend's
choice (TOKEN_LAYOUTS below): GPU backends split the last axis, vLLM's CPU
kernels keep K transposed. A manager block (the block ids the scheduler hands out) may be split into
``ratio`` kernel blocks: token ``t`` of a request lives in kernel block
``block_ids[t // block_size] * ratio + (t % block_size) // kernel_tokens``,
slot ``t % kernel_tokens``. Indexing the view does the stride arithmetic, so
every physical layout vLLM resolves works unchanged.

Store payloads are layer-major (protocol/namespace.py, KVLayout): for n
tokens, ``| layer 0: K[n,h,d] V[n,h,d] | layer 1: ... |``. A snapshot is the
raw bytes of every Mamba layer's state block, layer after layer; those bytes
mean whatever the installed vLLM's kernels make of them, so the namespace
names the vLLM version whenever it carries state (connector.py).

Why not gpu_staging.paged_kv.SequenceKV: that class owns one tensor in the
reference engine's ``layers x pages x 2 x tokens x heads x dim`` layout; vLLM's
views are per layer, K and V interleaved per head, in a layout chosen at
run time. The payload format and the staging discipline are the same.
"""

from __future__ import annotations

from collections.abc import Sequence
import torch
from torch import Tensor

#: torch dtype -> the dtype name a namespace records (protocol.namespace.DTYPE_BYTES).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int8: "int8",
    torch.uint8: "uint8",
}


class LayoutUnsupported(ValueError):
    """A cache layout this connector does not move (the connector then never loads or saves)."""


#: How an attention backend lays out one block of one head inside vLLM's [B, H, N, K ++ V] view.
#: "token_major": token n's K then V at [b, h, n, :] (FlashAttention and the other GPU backends, which
#: split the last axis). "cpu_attn": vLLM's CPU kernels reinterpret the block as [2, N, D] and keep K
#: transposed, ``K^T [D, N]`` then ``V [N, D]`` (checked against the kernel: tests/vllm and
#: :func:`check_cpu_layout` at start-up).
TOKEN_LAYOUTS = ("token_major", "cpu_attn")


class AttentionLayer:
    """One attention layer's view and the arithmetic from (block ids, token) to its K and V."""

    def __init__(self, *, name: str, view: Tensor, block_size: int, group: int = 0,
                 token_layout: str = "token_major") -> None:
        if view.dim() != 4 or view.shape[3] % 2 or block_size % view.shape[2]:
            raise LayoutUnsupported(f"layer {name}: view of shape {tuple(view.shape)}")
        if token_layout not in TOKEN_LAYOUTS:
            raise LayoutUnsupported(f"layer {name}: token layout {token_layout!r}")
        self.name, self.view, self.block_size, self.group = name, view, block_size, group
        """``group``: the KV cache group whose block table places this layer's tokens."""
        self.token_layout = token_layout
        blocks, heads, n, c = view.shape
        d = c // 2
        if token_layout == "cpu_attn":
            try:
                halves = view.view(blocks, heads, 2, n * d)  # what the kernel's own .view() needs too
            except RuntimeError as err:
                raise LayoutUnsupported(f"layer {name}: CPU blocks are not contiguous ({err})") from err
            self._k = halves[:, :, 0].view(blocks, heads, d, n)  # K^T: index [block, :, :, slot]
            self._v = halves[:, :, 1].view(blocks, heads, n, d)
        else:
            self._k, self._v = view[..., :d], view[..., d:]

    @property
    def kernel_tokens(self) -> int:
        return int(self.view.shape[2])

    @property
    def num_heads(self) -> int:
        return int(self.view.shape[1])

    @property
    def head_dim(self) -> int:
        return int(self.view.shape[3]) // 2

    @property
    def token_bytes(self) -> int:
        """Bytes of one token in this layer's payload (K and V)."""
        return 2 * self.num_heads * self.head_dim * self.view.element_size()

    def _index(self, block_ids: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
        pos = torch.arange(start, end, device=block_ids.device)
        within = pos % self.block_size
        ratio = self.block_size // self.kernel_tokens
        kernel_block = block_ids[pos // self.block_size] * ratio + within // self.kernel_tokens
        return kernel_block.to(self.view.device), (within % self.kernel_tokens).to(self.view.device)

    def gather(self, block_ids: Tensor, start: int, end: int) -> Tensor:
        """K and V of tokens [start, end): ``(2, n, heads, head_dim)``, a contiguous copy."""
        blocks, slots = self._index(block_ids, start, end)
        if self.token_layout == "cpu_attn":
            k = self._k[blocks, :, :, slots]  # (n, heads, d): the advanced indices lead
        else:
            k = self._k[blocks, :, slots, :]
        return torch.stack((k, self._v[blocks, :, slots, :]))

    def zero(self, block_ids: Tensor, start: int, end: int) -> None:
        """Zero the K and V of token slots [start, end): one index op for K, one for V."""
        if end <= start:
            return
        blocks, slots = self._index(block_ids, start, end)
        if self.token_layout == "cpu_attn":
            self._k[blocks, :, :, slots] = 0
        else:
            self._k[blocks, :, slots, :] = 0
        self._v[blocks, :, slots, :] = 0

    def scatter(self, block_ids: Tensor, start: int, kv: Tensor) -> None:
        """Write ``kv`` ``(2, n, heads, head_dim)`` at tokens [start, start + n)."""
        blocks, slots = self._index(block_ids, start, start + kv.shape[1])
        kv = kv.to(self.view.device)
        if self.token_layout == "cpu_attn":
            self._k[blocks, :, :, slots] = kv[0]
        else:
            self._k[blocks, :, slots, :] = kv[0]
        self._v[blocks, :, slots, :] = kv[1]


def check_cpu_layout(layer: AttentionLayer) -> None:
    """Prove the "cpu_attn" layout against vLLM's own CPU cache-write kernel on a scratch copy of one
    layer's shape; raises LayoutUnsupported when the kernel writes elsewhere (another ISA, another
    vLLM), so the connector idles instead of moving scrambled KV."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    _, heads, n, c = layer.view.shape
    d = c // 2
    scratch = torch.zeros(2, heads, n, c, dtype=layer.view.dtype)
    probe = AttentionLayer(name=layer.name, view=scratch, block_size=n, token_layout="cpu_attn")
    g = torch.Generator().manual_seed(0)
    kv = torch.randint(-64, 64, (2, n + 3, heads, d), generator=g).to(scratch.dtype)
    halves = scratch.view(2, heads, 2 * n, d)
    key_cache, value_cache = halves.chunk(2, dim=2)
    slots = torch.arange(n + 3, dtype=torch.long) + (n - 3)  # crosses the block boundary
    try:
        ops.cpu_attn_reshape_and_cache(kv[0], kv[1], key_cache, value_cache, slots,
                                       _get_attn_isa(scratch.dtype, n, d))
    except Exception as err:  # noqa: BLE001 -- an op this vLLM lacks: the layout is unknown
        raise LayoutUnsupported(f"CPU attention cache write unavailable: {err}") from err
    table = torch.tensor([0, 1])
    if not torch.equal(probe.gather(table, n - 3, 2 * n), kv):
        raise LayoutUnsupported("vLLM's CPU attention kernel lays out KV differently from 'cpu_attn'")


class VllmKV:
    """Every layer the connector moves: the attention layers (KV) and the Mamba layers (state) of
    any number of KV cache groups, as the worker registered them."""

    def __init__(self, attention: Sequence[AttentionLayer], state_views: Sequence[tuple[int, Tensor]] = ()) -> None:
        if not attention:
            raise LayoutUnsupported("no attention layer to move")
        first = attention[0]
        for layer in attention:
            if (layer.view.dtype, layer.num_heads, layer.head_dim) != (first.view.dtype, first.num_heads,
                                                                       first.head_dim):
                raise LayoutUnsupported(f"layer {layer.name}: attention layers differ in dtype or shape")
            if layer.view.shape[3] % 2:
                raise LayoutUnsupported(f"layer {layer.name}: K and V of different sizes")
        self.attention = list(attention)
        self.state_views = list(state_views)
        """(group, view) of every Mamba layer, in snapshot order."""

    @property
    def dtype(self) -> torch.dtype:
        return self.attention[0].view.dtype

    @property
    def layer_token_bytes(self) -> int:
        return self.attention[0].token_bytes

    @property
    def state_layer_bytes(self) -> int:
        if not self.state_views:
            return 0
        view = self.state_views[0][1]
        return view[0].numel() * view.element_size()

    @property
    def snapshot_bytes(self) -> int:
        return self.state_layer_bytes * len(self.state_views)

    # ------------------------------------------------------------ KV payloads

    def gather(self, out: Tensor, block_ids: Sequence[Tensor], start: int, end: int) -> None:
        """Write the payload of tokens [start, end), all layers, into ``out`` (uint8, its exact size).
        ``block_ids``: the request's block table of every KV cache group."""
        n = end - start
        per_layer = n * self.layer_token_bytes
        for i, layer in enumerate(self.attention):
            dst = out[i * per_layer : (i + 1) * per_layer].view(self.dtype).view(2, n, layer.num_heads,
                                                                                  layer.head_dim)
            dst.copy_(layer.gather(block_ids[layer.group], start, end))

    def zero_block_rest(self, block_ids: Sequence[Tensor], end: int) -> None:
        """Zero, in every attention layer, the slots of the block holding token ``end - 1`` that
        come after it: tokens [end, the block's end). vLLM zeroes the attention blocks it
        allocates, but not those a connector's asynchronous load fills
        (``skip_zeroing_group_ids``, v1/core/sched/scheduler.py), so a load that ends mid-block
        leaves the rest of its last block holding whatever the page held before: on a hybrid
        model, possibly a freed state's bytes, which read as attention KV can be NaN, and vLLM's
        CPU attention lets NaN in unused slots reach the output. Blocks the load covers whole
        are overwritten by it; blocks after the last are not the load's (vLLM zeroes them)."""
        for layer in self.attention:
            bs = layer.block_size
            layer.zero(block_ids[layer.group], end, -(-end // bs) * bs)

    def scatter_layer(self, layer: int, src: Tensor, block_ids: Sequence[Tensor], payload_start: int,
                      payload_tokens: int,
                      write_from: int, write_to: int) -> None:
        """From one layer's payload ``src`` (uint8) of ``payload_tokens`` tokens starting at token
        ``payload_start``, write tokens [write_from, write_to) (a sub-range of the payload's)."""
        att = self.attention[layer]
        kv = src.view(self.dtype).view(2, payload_tokens, att.num_heads, att.head_dim)
        a, b = write_from - payload_start, write_to - payload_start
        att.scatter(block_ids[att.group], write_from, kv[:, a:b])

    # ------------------------------------------------------------ state snapshots

    def gather_state(self, out: Tensor, block_ids: Sequence[Sequence[int]], index: int) -> None:
        """Every Mamba layer's state in block ``block_ids[group][index]``, layer after layer, into
        ``out`` (uint8)."""
        n = self.state_layer_bytes
        for i, (group, view) in enumerate(self.state_views):
            out[i * n : (i + 1) * n].copy_(view[block_ids[group][index]].reshape(-1).view(torch.uint8))

    def scatter_state(self, src: Tensor, block_ids: Sequence[Sequence[int]], index: int) -> None:
        n = self.state_layer_bytes
        for i, (group, view) in enumerate(self.state_views):
            block = view[block_ids[group][index]]
            block.copy_(src[i * n : (i + 1) * n].view(view.dtype).view(block.shape))


__all__ = ["DTYPE_NAMES", "TOKEN_LAYOUTS", "AttentionLayer", "LayoutUnsupported", "VllmKV", "check_cpu_layout"]
