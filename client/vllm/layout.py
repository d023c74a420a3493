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

Store payloads are layer-major and head-major (protocol/namespace.py, KVLayout,
hash scheme 2): for n tokens, ``| layer 0: K[H,n,d] V[H,n,d] | layer 1: ... |``
over all the model's KV heads. A tensor-parallel rank moves its own heads
(client/heads.py): the payload it reads, and the slice it contributes to a
save, is the same with its h heads, ``K[h,n,d] V[h,n,d]`` per layer. A
snapshot is every Mamba layer's state, layer after layer, each state tensor
regrouped by head units (:class:`StateCodec`; a rank's units); a state this
connector does not know to split is moved as the block's raw bytes, which
mean whatever the installed vLLM's kernels make of them (the namespace then
names the vLLM version).

Why not gpu_staging.paged_kv.SequenceKV: that class owns one tensor in the
reference engine's ``layers x pages x 2 x tokens x heads x dim`` layout; vLLM's
views are per layer, K and V interleaved per head, in a layout chosen at
run time. The payload format and the staging discipline are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
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
TORCH_DTYPES: dict[str, torch.dtype] = {name: dtype for dtype, name in DTYPE_NAMES.items()}


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


class StateCodec:
    """One Mamba layer's state block (vLLM packs a rank's state tensors back to back in it,
    ``MambaBase.bind_kv_cache``) <-> the rank's units of the canonical snapshot layer: each tensor
    as ``[channels or heads, ...]`` (a conv state vLLM keeps as window x channels is transposed),
    its rows regrouped by unit (client/heads.py ``StateShards.canonical_rows``). Without shards,
    the raw bytes (an opaque state, TP=1)."""

    def __init__(self, tensors: Sequence[tuple[tuple[int, ...], torch.dtype, bool]],
                 rows: Sequence[np.ndarray | None] | None = None) -> None:
        self.tensors: list[tuple[int, int, torch.dtype, tuple[int, ...], bool, Tensor | None]] = []
        """(byte offset in the block, bytes, dtype, shape, transposed, canonical rows or None)."""
        offset = 0
        for i, (shape, dtype, transposed) in enumerate(tensors):
            nbytes = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
            perm = None if rows is None else rows[i]
            if perm is not None and np.array_equal(perm, np.arange(len(perm))):
                perm = None
            self.tensors.append((offset, nbytes, dtype, tuple(shape), transposed,
                                 None if perm is None else torch.from_numpy(perm)))
            offset += nbytes
        self.layer_bytes = offset
        self.opaque = rows is None

    def _views(self, block: Tensor) -> list[tuple[int, int, Tensor, Tensor | None]]:
        """(offset, bytes, the tensor as [rows, rest...] over the block's bytes, rows) per tensor."""
        out = []
        for offset, nbytes, dtype, shape, transposed, rows in self.tensors:
            t = block[offset : offset + nbytes].view(dtype).view(shape)
            if transposed:
                t = t.transpose(0, 1)
            out.append((offset, nbytes, t, rows))
        return out

    def encode(self, block: Tensor, out: Tensor) -> None:
        """The block's state (uint8, ``layer_bytes``) into ``out`` (uint8), canonical order."""
        if self.opaque:
            out.copy_(block[: self.layer_bytes])
            return
        for offset, nbytes, t, rows in self._views(block):
            dst = out[offset : offset + nbytes].view(t.dtype).view(t.shape)
            dst.copy_(t if rows is None else t[rows.to(t.device)])

    def decode(self, src: Tensor, block: Tensor) -> None:
        """The reverse: canonical bytes ``src`` into the block."""
        if self.opaque:
            block[: self.layer_bytes].copy_(src)
            return
        for offset, nbytes, t, rows in self._views(block):
            canonical = src[offset : offset + nbytes].view(t.dtype).view(t.shape)
            if rows is None:
                t.copy_(canonical)
            else:
                t[rows.to(t.device)] = canonical


def _groups(payloads: Sequence[Payload], start: int, payload_bytes: Callable[[int], int]
            ) -> list[tuple[int, int, int, int, int]]:
    """Runs of payloads one kernel op moves: (region offset, count, tokens each, first used token
    within each, used tokens each), each a run of back-to-back payloads of equal length used whole,
    or a single payload used in part (the first, cut by a local hit; the last, a stored child of
    which only a prefix is the prompt's). Token ranges must follow one another."""
    for prev, nxt in zip(payloads, payloads[1:]):
        if prev.token_end != nxt.token_start:
            raise ValueError(f"payloads: tokens {prev.token_end} and {nxt.token_start} are not adjacent")
    out: list[tuple[int, int, int, int, int]] = []
    for p in payloads:
        lo = max(p.token_start, start) - p.token_start
        used = p.token_end - p.token_start - lo
        if used <= 0:
            continue
        whole = lo == 0 and used == p.num_tokens
        if out and whole:
            off, count, n, first, each = out[-1]
            if first == 0 and each == n == p.num_tokens and off + count * payload_bytes(n) == p.offset:
                out[-1] = (off, count + 1, n, 0, n)
                continue
        out.append((p.offset, 1, p.num_tokens, lo, used))
    return out


class VllmKV:
    """Every layer the connector moves: the attention layers (KV) and the Mamba layers (state) of
    any number of KV cache groups, as the worker registered them (one rank's heads)."""

    def __init__(self, attention: Sequence[AttentionLayer], state_views: Sequence[tuple[int, Tensor]] = (),
                 state_codec: StateCodec | None = None) -> None:
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
        if state_views and state_codec is None:
            view = state_views[0][1]
            state_codec = StateCodec([((view[0].numel(),), view.dtype, False)])
        self.state_codec = state_codec
        if state_codec is not None and state_views and \
                state_codec.layer_bytes > state_views[0][1][0].numel() * state_views[0][1].element_size():
            raise LayoutUnsupported("the Mamba views are smaller than the state tensors the spec names")
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
    def num_heads(self) -> int:
        """This rank's KV heads (the canonical ones it holds)."""
        return self.attention[0].num_heads

    @property
    def layer_token_bytes(self) -> int:
        """Bytes of one token in one layer of this rank's slice of a payload (its heads' K and V)."""
        return self.attention[0].token_bytes

    @property
    def state_layer_bytes(self) -> int:
        return self.state_codec.layer_bytes if self.state_codec is not None and self.state_views else 0

    @property
    def snapshot_bytes(self) -> int:
        """Bytes of this rank's slice of a snapshot (its state head units of every layer)."""
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

    def _payload_bytes(self, num_layers: int) -> Callable[[int], int]:
        per = num_layers * self.layer_token_bytes
        return lambda n: n * per

    def scatter_payloads(self, region: Tensor, payloads: Sequence[Payload], layer_start: int, layer_end: int,
                         block_ids: Sequence[BlockTable], start: int) -> None:
        """Write into the blocks the KV of payloads that sit in ``region`` (uint8): each holds
        layers [layer_start, layer_end) of its tokens for this rank's heads, head-major
        (``[layer][K|V][head][token][dim]``), and the payloads' token ranges follow one another.
        Tokens from ``start`` on are written (a local hit may end inside the first payload).

        Few torch ops, whatever the number of payloads: every torch op lets go of the GIL, which
        vLLM's engine loop may then hold until the switch interval (5 ms) takes it back
        (client/vllm/worker.py, docs/vllm.md). A run of back-to-back payloads of one length is one
        permuting copy into token order (``[layers, K|V, tokens, heads, dim]``); a payload used in
        part is one more; then one index op for K and one for V per layer."""
        num_layers = layer_end - layer_start
        groups = _groups(payloads, start, self._payload_bytes(num_layers))
        if not groups:
            return
        h, d = self.num_heads, self.attention[0].head_dim
        total = sum(count * used for _, count, _, _, used in groups)
        kv = self.scratch("load", (num_layers, 2, total, h, d))
        pos = 0
        for offset, count, n, first, used in groups:
            nbytes = count * n * num_layers * self.layer_token_bytes
            src = region[offset : offset + nbytes].view(self.dtype).view(count, num_layers, 2, h, n, d)
            src = src[..., first : first + used, :]
            dst = kv[:, :, pos : pos + count * used].view(num_layers, 2, count, used, h, d)
            dst.copy_(src.permute(1, 2, 0, 4, 3, 5))
            pos += count * used
        token_from = max(payloads[0].token_start, start)
        slots: dict[int, TokenIndex] = {}
        for i in range(num_layers):
            att = self.attention[layer_start + i]
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.put(slots[att.group], kv[i])

    def gather_payloads(self, out: Tensor, payloads: Sequence[Payload], block_ids: Sequence[BlockTable]) -> None:
        """The reverse, for saves: write into ``out`` (uint8) the payloads, every layer, this rank's
        heads, of tokens that follow one another; each payload carries all its tokens
        (``num_tokens`` equals ``token_end - token_start``). Two index ops per layer out of the
        blocks, then one permuting copy per run of equal-length payloads into ``out`` (a
        prompt-end save runs in the step that computes the prompt's first token)."""
        for p in payloads:
            if p.num_tokens != p.token_end - p.token_start:
                raise ValueError("gather_payloads: a save's payload carries all its tokens")
        num_layers = len(self.attention)
        groups = _groups(payloads, 0, self._payload_bytes(num_layers))
        if not groups:
            return
        h, d = self.num_heads, self.attention[0].head_dim
        total = sum(count * used for _, count, _, _, used in groups)
        token_from = payloads[0].token_start
        kv = self.scratch("save", (num_layers, 2, total, h, d))
        slots: dict[int, TokenIndex] = {}
        for i, att in enumerate(self.attention):
            if att.group not in slots:
                slots[att.group] = att.token_index(block_ids[att.group], token_from, token_from + total)
            att.take(slots[att.group], kv[i])
        pos = 0
        for offset, count, n, _, _ in groups:
            nbytes = count * n * num_layers * self.layer_token_bytes
            dst = out[offset : offset + nbytes].view(self.dtype).view(count, num_layers, 2, h, n, d)
            src = kv[:, :, pos : pos + count * n].view(num_layers, 2, count, n, h, d)
            dst.copy_(src.permute(2, 0, 1, 4, 3, 5).to(dst.device))
            pos += count * n

    # ------------------------------------------------------------ state snapshots

    def gather_state(self, out: Tensor, block_ids: Sequence[Sequence[int]], index: int) -> None:
        """Every Mamba layer's state in block ``block_ids[group][index]``, layer after layer, into
        ``out`` (uint8), in the canonical order (this rank's units)."""
        assert self.state_codec is not None
        n = self.state_layer_bytes
        for i, (group, view) in enumerate(self.state_views):
            self.state_codec.encode(view[block_ids[group][index]].reshape(-1).view(torch.uint8), out[i * n : (i + 1) * n])

    def scatter_state(self, src: Tensor, block_ids: Sequence[Sequence[int]], index: int) -> None:
        assert self.state_codec is not None
        n = self.state_layer_bytes
        for i, (group, view) in enumerate(self.state_views):
            block = view[block_ids[group][index]].reshape(-1).view(torch.uint8)
            self.state_codec.decode(src[i * n : (i + 1) * n], block)


__all__ = ["DTYPE_NAMES", "TORCH_DTYPES", "TOKEN_LAYOUTS", "AttentionLayer", "BlockTable", "LayoutUnsupported", "Payload",
           "StateCodec", "TokenIndex", "VllmKV", "learn_cpu_layout"]
