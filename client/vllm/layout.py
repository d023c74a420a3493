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
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

BlockTable = Tensor | np.ndarray
"""A request's block ids in one KV cache group (integers, on the host)."""

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

    def token_index(self, block_ids: BlockTable, start: int, end: int) -> tuple[Tensor, Tensor]:
        """(kernel block, slot) of tokens [start, end), as index tensors on the view's device.
        Computed with numpy: no torch op, so no hand-off of the GIL (client/vllm/worker.py)."""
        pos = np.arange(start, end)
        within = pos % self.block_size
        ratio = self.block_size // self.kernel_tokens
        kernel_block = np.asarray(block_ids, dtype=np.int64)[pos // self.block_size] * ratio + within // self.kernel_tokens
        return (torch.from_numpy(kernel_block).to(self.view.device),
                torch.from_numpy(within % self.kernel_tokens).to(self.view.device))

    def gather(self, block_ids: BlockTable, start: int, end: int) -> Tensor:
        """K and V of tokens [start, end): ``(2, n, heads, head_dim)``, a contiguous copy."""
        out = torch.empty((2, end - start, self.num_heads, self.head_dim), dtype=self.view.dtype,
                          device=self.view.device)
        self.take(*self.token_index(block_ids, start, end), out)
        return out

    def take(self, blocks: Tensor, slots: Tensor, out: Tensor) -> None:
        """Copy the K and V of the n token slots ``(blocks, slots)`` (:meth:`token_index`) into
        ``out`` ``(2, n, heads, head_dim)``."""
        if self.token_layout == "cpu_attn":
            out[0] = self._k[blocks, :, :, slots]  # (n, heads, d): the advanced indices lead
        else:
            out[0] = self._k[blocks, :, slots, :]
        out[1] = self._v[blocks, :, slots, :]

    def zero(self, block_ids: BlockTable, start: int, end: int) -> None:
        """Zero the K and V of token slots [start, end): one index op for K, one for V."""
        if end <= start:
            return
        blocks, slots = self.token_index(block_ids, start, end)
        if self.token_layout == "cpu_attn":
            self._k[blocks, :, :, slots] = 0
        else:
            self._k[blocks, :, slots, :] = 0
        self._v[blocks, :, slots, :] = 0

    def put(self, blocks: Tensor, slots: Tensor, kv: Tensor) -> None:
        """Write ``kv`` ``(2, n, heads, head_dim)`` at the n token slots ``(blocks, slots)``
        (:meth:`token_index`): one index op for K, one for V."""
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


@dataclass(frozen=True, slots=True)
class Payload:
    """One KV payload in a staging region: where it sits, how many tokens it holds, and the
    request's tokens [token_start, token_end) it carries (its first ``token_end - token_start``)."""

    offset: int
    num_tokens: int
    token_start: int
    token_end: int


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

    def zero_block_rest(self, block_ids: Sequence[BlockTable], end: int) -> None:
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

    def _payload_rows(self, payloads: Sequence[Payload], num_layers: int, start: int
                      ) -> tuple[np.ndarray, int, int, int] | None:
        """Where each token's K and V rows sit in a region of back-to-back payloads of
        ``num_layers`` layers each (layer-major: per layer K[n] then V[n], a row being one token's
        ``heads * head_dim`` elements), for the tokens from ``start`` on. Returns (rows
        ``[layers, K|V, tokens]``, first token, number of tokens, rows the region spans), or None
        when no token is used. Computed with numpy, which keeps the GIL (scatter_payloads)::

            region:   | payload 0: layer a: K[n0] V[n0] | layer a+1: K V | ... | payload 1: ... |
        """
        if not payloads:
            return None
        first = self.attention[0]
        row_bytes = first.num_heads * first.head_dim * first.view.element_size()
        for prev, nxt in zip(payloads, payloads[1:]):
            if prev.token_end != nxt.token_start:
                raise ValueError(f"payloads: tokens {prev.token_end} and {nxt.token_start} are not adjacent")
        offset = np.array([p.offset for p in payloads], dtype=np.int64)
        if (offset % row_bytes).any():
            raise ValueError("payloads: a payload not aligned to a token row")
        n = np.array([p.num_tokens for p in payloads], dtype=np.int64)
        s = np.array([p.token_start for p in payloads], dtype=np.int64)
        a = np.maximum(s, start)
        m = np.maximum(np.array([p.token_end for p in payloads], dtype=np.int64) - a, 0)
        total = int(m.sum())
        if total == 0:
            return None
        # Row of token a_i + k's K in the first layer, for every used token, payload after payload.
        k_rows = np.repeat(offset // row_bytes + (a - s) - (np.cumsum(m) - m), m) + np.arange(total)
        per = np.repeat(n, m)
        planes = (2 * np.arange(num_layers)[:, None] + np.arange(2)[None, :]).reshape(num_layers, 2, 1)
        rows = k_rows[None, None, :] + planes * per[None, None, :]
        rows_end = int((offset // row_bytes + 2 * num_layers * n).max())
        return rows, int(max(payloads[0].token_start, start)), total, rows_end

    def _rows_view(self, region: Tensor, rows_end: int) -> Tensor:
        first = self.attention[0]
        nbytes = rows_end * first.num_heads * first.head_dim * first.view.element_size()
        return region[:nbytes].view(self.dtype).view(rows_end, first.num_heads, first.head_dim)

    def scatter_payloads(self, region: Tensor, payloads: Sequence[Payload], layer_start: int, layer_end: int,
                         block_ids: Sequence[BlockTable], start: int) -> None:
        """Write into the blocks the KV of payloads that sit in ``region`` (uint8): each holds
        layers [layer_start, layer_end) of its tokens, layer-major, and the payloads' token ranges
        follow one another. Tokens from ``start`` on are written (a local hit may end inside the
        first payload).

        A load of 2,239 tokens is 140 payloads of 16 tokens; written one by one that was a dozen
        torch ops each, per layer, and every torch op lets go of the GIL, which vLLM's engine
        loop may then hold until the switch interval (5 ms) takes it back (client/vllm/worker.py,
        docs/vllm.md). Here it is one gather out of the region for every layer at once, then one
        index op for K and one for V per layer."""
        where = self._payload_rows(payloads, layer_end - layer_start, start)
        if where is None:
            return
        rows, token_from, total, rows_end = where
        src = self._rows_view(region, rows_end)
        kv = src[torch.from_numpy(rows).to(src.device)]  # [layers, 2, tokens, heads, head_dim]
        slots: dict[int, tuple[Tensor, Tensor]] = {}
        for i in range(layer_end - layer_start):
            att = self.attention[layer_start + i]
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.put(*slots[att.group], kv[i])

    def gather_payloads(self, out: Tensor, payloads: Sequence[Payload], block_ids: Sequence[BlockTable]) -> None:
        """The reverse, for saves: write into ``out`` (uint8) the payloads, every layer, of tokens
        that follow one another; each payload carries all its tokens (``num_tokens`` equals
        ``token_end - token_start``). Two index ops per layer out of the blocks, then one into
        ``out``, where a payload at a time took a dozen per payload and layer (a prompt-end save
        runs in the step that computes the prompt's first token)."""
        for p in payloads:
            if p.num_tokens != p.token_end - p.token_start:
                raise ValueError("gather_payloads: a save's payload carries all its tokens")
        where = self._payload_rows(payloads, len(self.attention), 0)
        if where is None:
            return
        rows, token_from, total, rows_end = where
        first = self.attention[0]
        kv = torch.empty((len(self.attention), 2, total, first.num_heads, first.head_dim), dtype=self.dtype,
                         device=first.view.device)
        slots: dict[int, tuple[Tensor, Tensor]] = {}
        for i, att in enumerate(self.attention):
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.take(*slots[att.group], kv[i])
        dst = self._rows_view(out, rows_end)
        dst[torch.from_numpy(rows).to(dst.device)] = kv.to(dst.device)

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


__all__ = ["DTYPE_NAMES", "TOKEN_LAYOUTS", "AttentionLayer", "BlockTable", "LayoutUnsupported", "Payload", "VllmKV",
           "check_cpu_layout"]
