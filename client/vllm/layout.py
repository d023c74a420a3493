"""vLLM's paged KV (and Mamba state) tensors <-> store payloads.

vLLM 0.32 hands a connector one 4-D view per layer (``register_kv_caches``),
whatever the physical layout (``vllm/v1/kv_cache_layout.py``)::

    attention layer:  [kernel_blocks, kv_heads, kernel_block_tokens, head_size + head_size_v]   (K ++ V)
    mamba layer:      [blocks, heads, states, state_bytes]                                      (int8)

Inside a block, where a token's K and V sit is the attention backend's
choice (TOKEN_LAYOUTS below): GPU backends split the last axis; vLLM's CPU
kernels pack each block by ISA (vec keeps K transposed, AMX pre-packs tile
rows), so on CPU the layout is learned from the kernel (slot_map.py). A manager block (the block ids the scheduler hands out) may be split into
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

from .slot_map import KernelWrite, LayoutUnsupported, SlotMap, cpu_kernel_write, learn_slot_map

BlockTable = Tensor | np.ndarray
"""A request's block ids in one KV cache group (integers, on the host)."""

#: torch dtype -> the dtype name a namespace records (protocol.namespace.DTYPE_BYTES).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int8: "int8",
    torch.uint8: "uint8",
}


#: How an attention backend lays out one block of one head inside vLLM's [B, H, N, K ++ V] view.
#: "token_major": token n's K then V at [b, h, n, :] (FlashAttention and the other GPU backends, which
#: split the last axis). "slot_map": wherever a :class:`~.slot_map.SlotMap` learned from the
#: backend's own cache-write kernel says (vLLM's CPU kernels, whose packing differs by ISA).
TOKEN_LAYOUTS = ("token_major", "slot_map")


class AttentionLayer:
    """One attention layer's view and the arithmetic from (block ids, token) to its K and V."""

    def __init__(self, *, name: str, view: Tensor, block_size: int, group: int = 0,
                 token_layout: str = "token_major", slot_map: SlotMap | None = None) -> None:
        if view.dim() != 4 or view.shape[3] % 2 or block_size % view.shape[2]:
            raise LayoutUnsupported(f"layer {name}: view of shape {tuple(view.shape)}")
        if token_layout not in TOKEN_LAYOUTS:
            raise LayoutUnsupported(f"layer {name}: token layout {token_layout!r}")
        self.name, self.view, self.block_size, self.group = name, view, block_size, group
        """``group``: the KV cache group whose block table places this layer's tokens."""
        self.token_layout = token_layout
        blocks, heads, n, c = view.shape
        d = c // 2
        self._map: SlotMap | None = None
        """A slot map moved element by element (a layout no view expresses), else None."""
        if token_layout == "slot_map":
            if slot_map is None or slot_map.k.shape != (n, heads, d):
                raise LayoutUnsupported(f"layer {name}: no slot map of shape {(n, heads, d)}")
            try:
                self._flat = view.view(blocks, heads * n * c)  # what the kernel's own .view() needs too
            except RuntimeError as err:
                raise LayoutUnsupported(f"layer {name}: CPU blocks are not contiguous ({err})") from err
            strides = slot_map.strided()
            if strides is None:
                self._map = slot_map
            else:  # K and V as [block, slot, head, dim] views over the blocks' memory
                row = self._flat.stride(0)
                self._k, self._v = (self._flat.as_strided((blocks, n, heads, d), (row, st, sh, sj),
                                                          self._flat.storage_offset() + base)
                                    for base, st, sh, sj in strides)
        else:  # [block, head, slot, K ++ V] -> K and V as [block, slot, head, dim]
            self._k, self._v = view[..., :d].transpose(1, 2), view[..., d:].transpose(1, 2)

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

    def token_index(self, block_ids: BlockTable, start: int, end: int) -> TokenIndex:
        """Where tokens [start, end) sit, as index tensors on the view's device: (kernel block,
        slot), and where the layout is moved element by element the offsets of their K and V
        inside the block. Computed with numpy: no torch op, so no hand-off of the GIL
        (client/vllm/worker.py)."""
        pos = np.arange(start, end)
        within = pos % self.block_size
        ratio = self.block_size // self.kernel_tokens
        kernel_block = np.asarray(block_ids, dtype=np.int64)[pos // self.block_size] * ratio + within // self.kernel_tokens
        slot = within % self.kernel_tokens
        device = self.view.device
        if self._map is None:
            return TokenIndex(blocks=torch.from_numpy(kernel_block).to(device), slots=torch.from_numpy(slot).to(device))
        return TokenIndex(blocks=torch.from_numpy(kernel_block[:, None, None]).to(device),
                          slots=torch.from_numpy(slot).to(device),
                          k=torch.from_numpy(self._map.k[slot]).to(device),
                          v=torch.from_numpy(self._map.v[slot]).to(device))

    def gather(self, block_ids: BlockTable, start: int, end: int) -> Tensor:
        """K and V of tokens [start, end): ``(2, n, heads, head_dim)``, a contiguous copy."""
        out = torch.empty((2, end - start, self.num_heads, self.head_dim), dtype=self.view.dtype,
                          device=self.view.device)
        self.take(self.token_index(block_ids, start, end), out)
        return out

    def take(self, where: TokenIndex, out: Tensor) -> None:
        """Copy the K and V of the token slots ``where`` (:meth:`token_index`) into ``out``
        ``(2, n, heads, head_dim)``: one index op for K, one for V."""
        if where.k is not None and where.v is not None:
            out[0] = self._flat[where.blocks, where.k]
            out[1] = self._flat[where.blocks, where.v]
        else:
            out[0] = self._k[where.blocks, where.slots]
            out[1] = self._v[where.blocks, where.slots]

    def zero(self, block_ids: BlockTable, start: int, end: int) -> None:
        """Zero the K and V of token slots [start, end): one index op for K, one for V."""
        if end <= start:
            return
        where = self.token_index(block_ids, start, end)
        if where.k is not None and where.v is not None:
            self._flat[where.blocks, where.k] = 0
            self._flat[where.blocks, where.v] = 0
        else:
            self._k[where.blocks, where.slots] = 0
            self._v[where.blocks, where.slots] = 0

    def put(self, where: TokenIndex, kv: Tensor) -> None:
        """Write ``kv`` ``(2, n, heads, head_dim)`` at the token slots ``where``
        (:meth:`token_index`): one index op for K, one for V."""
        if where.k is not None and where.v is not None:
            self._flat[where.blocks, where.k] = kv[0]
            self._flat[where.blocks, where.v] = kv[1]
        else:
            self._k[where.blocks, where.slots] = kv[0]
            self._v[where.blocks, where.slots] = kv[1]


def learn_cpu_layout(view: Tensor, isa: str | None = None, write: KernelWrite | None = None) -> SlotMap:
    """The slot map of an attention view ``[blocks, heads, block_tokens, 2 * head_dim]``, learned from
    vLLM's CPU cache-write kernel for ``isa`` (or the one vLLM picks for the view's dtype and shape;
    slot_map.py), or from ``write`` (tests). Raises LayoutUnsupported where it cannot be learned."""
    _, heads, n, c = view.shape
    d = c // 2
    kernel = write if write is not None else cpu_kernel_write(view.dtype, n, d, isa)
    return learn_slot_map(heads, n, d, view.dtype, kernel)


@dataclass(frozen=True, slots=True)
class TokenIndex:
    """Where n tokens of a request sit in one attention layer's view (AttentionLayer.token_index)."""

    blocks: Tensor
    """Kernel block of each token: ``[n]``, or ``[n, 1, 1]`` beside a slot map's offsets."""
    slots: Tensor
    """Slot of each token inside its kernel block: ``[n]``."""
    k: Tensor | None = None
    """With a slot map: offsets of each token's K elements in its block, ``[n, heads, head_dim]``."""
    v: Tensor | None = None


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
        self._scratch: dict[str, Tensor] = {}

    def scratch(self, purpose: str, shape: tuple[int, ...]) -> Tensor:
        """A tensor of ``shape`` in a buffer kept from call to call for ``purpose`` (grown, never
        shrunk): a load's or a save's KV of every layer, tens of MB. Allocated afresh each time,
        such a buffer is new memory (glibc maps allocations over 32 MiB anew and unmaps them when
        freed), and writing it page-faults every 4 KiB: measured here, a 2,239-token save's copy
        spent most of its 110-150 ms there. One buffer per purpose, because the two run at once
        on different threads: loads (``"load"``, on the client's loop, one at a time) and saves'
        copies (``"save"``, on vLLM's engine thread, one at a time)."""
        numel = 1
        for d in shape:
            numel *= d
        buf = self._scratch.get(purpose)
        if buf is None or buf.numel() < numel:
            first = self.attention[0].view
            # Not an inference tensor, whichever thread grows it: vLLM's engine thread runs under
            # torch.inference_mode, the client's loop does not, and an inference tensor refuses
            # in-place writes outside that mode.
            with torch.inference_mode(False):
                buf = self._scratch[purpose] = torch.zeros(numel, dtype=first.dtype, device=first.device)
        return buf[:numel].view(shape)

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
        first = self.attention[0]
        kv = self.scratch("load", (rows.shape[0], 2, total, first.num_heads, first.head_dim))  # layers, K|V, tokens
        flat_rows = torch.from_numpy(rows.reshape(-1)).to(src.device)
        torch.index_select(src, 0, flat_rows, out=kv.view(-1, first.num_heads, first.head_dim))
        slots: dict[int, TokenIndex] = {}
        for i in range(layer_end - layer_start):
            att = self.attention[layer_start + i]
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.put(slots[att.group], kv[i])

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
        kv = self.scratch("save", (len(self.attention), 2, total, first.num_heads, first.head_dim))
        slots: dict[int, TokenIndex] = {}
        for i, att in enumerate(self.attention):
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.take(slots[att.group], kv[i])
        dst = self._rows_view(out, rows_end)
        dst.index_copy_(0, torch.from_numpy(rows.reshape(-1)).to(dst.device),
                        kv.to(dst.device).view(-1, first.num_heads, first.head_dim))

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


__all__ = ["DTYPE_NAMES", "TOKEN_LAYOUTS", "AttentionLayer", "BlockTable", "LayoutUnsupported", "Payload",
           "TokenIndex", "VllmKV", "learn_cpu_layout"]
