"""SGLang's host pages <-> store payloads.

HiCache's storage tier reads and writes SGLang's *host* pools (L2), never the
GPU. A storage backend is handed host indices and the pools themselves
(``register_mem_pool_host`` / ``register_mem_host_pool_v2``), whose tensors
have one of these layouts (``--hicache-mem-layout``;
``sglang/srt/mem_cache/pool_host/mha.py``)::

    layer_first        kv_buffer[2, layers, tokens, heads, dim]
    page_first         kv_buffer[2, tokens, layers, heads, dim]
    page_first_direct  kv_buffer[2, pages, layers, page_tokens, heads, dim]
    page_head          kv_buffer[2, pages, heads, page_tokens, layers, dim]

Store payloads are layer-major and head-major (protocol/namespace.py, KVLayout,
hash scheme 2): one page of P tokens is ``| layer 0: K[h,P,d] V[h,P,d] | layer
1: ... |``, i.e. a ``[layers, 2, heads, P, dim]`` tensor -- the layout vLLM's
connector writes too. None of SGLang's layouts is that, so a batch of pages is
gathered with one indexing copy (and scattered back the same way);
tests/sglang checks the result against SGLang's own ``get_data_page``.
``page_unified`` (K and V interleaved inside head groups) is not supported.

A Mamba state slot (``pool_host/mamba.py``) holds per layer one temporal
(SSM) tensor and the conv tensors, each with its own dtype. Where the model's
state is known to split by heads (client/heads.py: LFM2's short conv, a
gated-delta-net), its snapshot is the canonical one vLLM writes too: per layer,
the conv states then the recurrent state, each ``[units, ...]`` with its rows
regrouped by head unit. Otherwise it is SGLang's own bytes, layer-major:
``| layer 0: temporal, conv_0, ... | layer 1: ... |``. Extra slot side states
(registered by some models) are not moved: such a pool is unsupported.

Imports torch only; nothing here knows SGLang's classes, only the attributes
its host pools expose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from prefixstore.protocol.namespace import KVLayout, StateLayout
from ..heads import StateShards

#: torch dtype -> the dtype name a namespace records (protocol.namespace.DTYPE_BYTES).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
    torch.float8_e4m3fn: "float8_e4m3fn", torch.float8_e5m2: "float8_e5m2", torch.int8: "int8",
    torch.uint8: "uint8",
}

KV_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


class LayoutUnsupported(ValueError):
    """A host pool this backend does not move (the backend then answers every call with a miss)."""


class MHAHostPool(Protocol):
    """What this module reads of SGLang's ``MHATokenToKVPoolHost``."""

    kv_buffer: Tensor
    layout: str
    page_size: int
    layer_num: int
    head_num: int
    head_dim: int
    v_head_dim: int
    dtype: torch.dtype


class MambaHostPool(Protocol):
    """What this module reads of SGLang's ``MambaPoolHost``."""

    temporal_buffer: Tensor
    conv_buffer: list[Tensor]
    slot_state_buffers: list[Tensor]
    layout: str
    num_mamba_layers: int


@dataclass(frozen=True)
class HostKV:
    """Gather/scatter between an MHA host pool and layer-major page payloads."""

    pool: MHAHostPool

    @classmethod
    def of(cls, pool: MHAHostPool) -> HostKV:
        layout = getattr(pool, "layout", None)
        if layout not in KV_LAYOUTS:
            raise LayoutUnsupported(f"host KV layout {layout!r} (supported: {list(KV_LAYOUTS)})")
        for name in ("kv_buffer", "page_size", "layer_num", "head_num", "head_dim", "dtype"):
            if getattr(pool, name, None) is None:
                raise LayoutUnsupported(f"{type(pool).__name__} has no {name} (only MHA host pools are moved)")
        if getattr(pool, "v_head_dim", pool.head_dim) != pool.head_dim:
            raise LayoutUnsupported(f"K head_dim {pool.head_dim} != V head_dim {pool.v_head_dim}")
        if pool.dtype not in DTYPE_NAMES:
            raise LayoutUnsupported(f"KV dtype {pool.dtype}")
        if pool.kv_buffer.device.type != "cpu":
            raise LayoutUnsupported(f"host KV buffer on {pool.kv_buffer.device}")
        return cls(pool)

    @property
    def layout(self) -> KVLayout:
        p = self.pool
        return KVLayout(num_layers=p.layer_num, num_heads=p.head_num, head_dim=p.head_dim, dtype=DTYPE_NAMES[p.dtype])

    @property
    def page_tokens(self) -> int:
        return self.pool.page_size

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """One payload: [layers, 2, heads, page_tokens, dim]."""
        p = self.pool
        return (p.layer_num, 2, p.head_num, p.page_size, p.head_dim)

    @property
    def page_bytes(self) -> int:
        return math.prod(self.page_shape) * self.pool.dtype.itemsize

    def _pages(self, host_indices: Tensor) -> Tensor:
        """First token index of every page, as page numbers (page-addressed layouts)."""
        P = self.pool.page_size
        return host_indices[::P].to(torch.long) // P

    def gather(self, host_indices: Tensor) -> Tensor:
        """Pages at ``host_indices`` (P token indices per page) -> [pages, layers, 2, heads, P, dim]."""
        p, kv = self.pool, self.pool.kv_buffer
        P, L, H, D = p.page_size, p.layer_num, p.head_num, p.head_dim
        n = host_indices.numel() // P
        idx = host_indices.to(torch.long)
        if p.layout == "layer_first":  # [2, L, tokens, H, D]
            out = kv[:, :, idx].view(2, L, n, P, H, D).permute(2, 1, 0, 3, 4, 5)
        elif p.layout == "page_first":  # [2, tokens, L, H, D]
            out = kv[:, idx].view(2, n, P, L, H, D).permute(1, 3, 0, 2, 4, 5)
        elif p.layout == "page_first_direct":  # [2, pages, L, P, H, D]
            out = kv[:, self._pages(idx)].permute(1, 2, 0, 3, 4, 5)
        else:  # page_head: [2, pages, H, P, L, D]
            out = kv[:, self._pages(idx)].permute(1, 4, 0, 3, 2, 5)
        return out.transpose(3, 4).contiguous()  # [n, L, 2, P, H, D] -> head-major

    def scatter(self, host_indices: Tensor, pages: Tensor) -> None:
        """The inverse of :meth:`gather`: ``pages`` [n, layers, 2, heads, P, dim] into the host pool."""
        p, kv = self.pool, self.pool.kv_buffer
        P, L, H, D = p.page_size, p.layer_num, p.head_num, p.head_dim
        n = pages.shape[0]
        pages = pages.transpose(3, 4)  # token-major, as the layouts below index it
        idx = host_indices.to(torch.long)
        if p.layout == "layer_first":
            kv[:, :, idx] = pages.permute(2, 1, 0, 3, 4, 5).reshape(2, L, n * P, H, D)
        elif p.layout == "page_first":
            kv[:, idx] = pages.permute(2, 0, 3, 1, 4, 5).reshape(2, n * P, L, H, D)
        elif p.layout == "page_first_direct":
            kv[:, self._pages(idx)] = pages.permute(2, 0, 1, 3, 4, 5)
        else:
            kv[:, self._pages(idx)] = pages.permute(2, 0, 4, 3, 1, 5)

    def empty(self, num_pages: int) -> Tensor:
        return torch.empty((num_pages, *self.page_shape), dtype=self.pool.dtype)


@dataclass(frozen=True)
class HostState:
    """Gather/scatter between a Mamba host pool slot and a layer-major snapshot payload: canonical
    (``shards``: the conv states then the recurrent state, rows by head unit) or SGLang's own
    bytes (temporal, then the conv states)."""

    pool: MambaHostPool
    tensors: tuple[tuple[int, tuple[int, ...], torch.dtype], ...]
    """(buffer index, per-layer shape, dtype) of every moved tensor, in snapshot order."""
    shards: StateShards | None = None
    rows: tuple[Tensor | None, ...] = ()
    """With ``shards``: per tensor, the buffer's row of each canonical row (None: the same order)."""

    @classmethod
    def of(cls, pool: MambaHostPool, shards: StateShards | None = None) -> HostState:
        """The pool's state; canonical when ``shards`` (the model's, client/heads.py) describes its
        tensors (one rank of TP=1 holds every unit), else SGLang's own bytes."""
        if pool.layout not in ("page_first", "page_first_direct", "layer_first"):
            raise LayoutUnsupported(f"host Mamba layout {pool.layout!r}")
        if getattr(pool, "slot_state_buffers", None):
            raise LayoutUnsupported("Mamba slots with registered side states (not moved by this backend)")
        tensors = []
        for i, buf in enumerate(cls._buffers(pool)):
            shape = tuple(buf.shape[3:] if pool.layout != "layer_first" else buf.shape[2:])
            if buf.device.type != "cpu":
                raise LayoutUnsupported(f"host Mamba buffer on {buf.device}")
            if buf.dtype not in DTYPE_NAMES:
                raise LayoutUnsupported(f"Mamba state dtype {buf.dtype}")
            if math.prod(shape):  # conv-only layers have an empty temporal state
                tensors.append((i, shape, buf.dtype))
        if not tensors:
            raise LayoutUnsupported("Mamba pool with no state")
        if shards is not None:
            canonical = [*tensors[1:], tensors[0]] if tensors[0][0] == 0 else tensors  # conv states first
            fits = len(canonical) == len(shards.tensors) and all(
                shape[0] == t.local_rows(1) and tuple(shape[1:]) == t.rest and DTYPE_NAMES[dtype] == t.dtype
                for (_, shape, dtype), t in zip(canonical, shards.tensors))
            if fits:
                rows = tuple(cls._perm(shards.canonical_rows(k, 1)) for k in range(len(canonical)))
                return cls(pool, tuple(canonical), shards, rows)
        return cls(pool, tuple(tensors))

    @staticmethod
    def _perm(rows: np.ndarray) -> Tensor | None:
        return None if np.array_equal(rows, np.arange(len(rows))) else torch.from_numpy(rows)

    @staticmethod
    def _buffers(pool: MambaHostPool) -> list[Tensor]:
        return [pool.temporal_buffer, *pool.conv_buffer]

    @property
    def num_layers(self) -> int:
        return self.pool.num_mamba_layers

    @property
    def layer_bytes(self) -> int:
        return sum(math.prod(shape) * dtype.itemsize for _, shape, dtype in self.tensors)

    @property
    def snapshot_bytes(self) -> int:
        return self.num_layers * self.layer_bytes

    @property
    def layout(self) -> StateLayout:
        """Canonical: the shards' layout (addressable per head unit, what vLLM names too). Else
        every tensor one dtype: their shapes in that dtype; mixed (fp32 SSM, bf16 conv, the usual
        case): each layer as opaque bytes, and :meth:`description` goes into the namespace revision."""
        if self.shards is not None:
            return self.shards.layout(self.num_layers)
        dtypes = {dtype for _, _, dtype in self.tensors}
        if len(dtypes) == 1:
            return StateLayout(num_layers=self.num_layers, shapes=tuple(s for _, s, _ in self.tensors),
                               dtype=DTYPE_NAMES[dtypes.pop()])
        return StateLayout(num_layers=self.num_layers, shapes=((self.layer_bytes,),), dtype="uint8")

    def description(self) -> str:
        """What the bytes of one layer are, in order (for the namespace revision)."""
        names = ["temporal"] + [f"conv{i}" for i in range(len(self.pool.conv_buffer))]
        return ",".join(f"{names[i]}:{DTYPE_NAMES[d]}{list(s)}" for i, s, d in self.tensors)

    def _slot(self, buf: Tensor, slot: int) -> Tensor:
        """One slot of a buffer as [layers, *shape]."""
        if self.pool.layout == "layer_first":  # [layers, slots, *shape]
            return buf[:, slot]
        return buf[slot, :, 0]  # page_first*: [slots, layers, 1, *shape]

    def gather(self, slot: int) -> Tensor:
        """Slot ``slot`` -> uint8 [layers, layer_bytes]."""
        bufs = self._buffers(self.pool)
        L = self.num_layers
        parts = []
        for k, (i, _, _) in enumerate(self.tensors):
            t = self._slot(bufs[i], slot)
            rows = self.rows[k] if self.rows else None
            if rows is not None:
                t = t[:, rows]
            parts.append(t.contiguous().view(torch.uint8).reshape(L, -1))
        return torch.cat(parts, dim=1)

    def scatter(self, slot: int, payload: Tensor) -> None:
        """The inverse of :meth:`gather` (``payload``: uint8, snapshot_bytes)."""
        bufs = self._buffers(self.pool)
        layers = payload.reshape(self.num_layers, self.layer_bytes)
        start = 0
        for k, (i, shape, dtype) in enumerate(self.tensors):
            size = math.prod(shape) * dtype.itemsize
            part = layers[:, start : start + size].contiguous().view(dtype).reshape(self.num_layers, *shape)
            rows = self.rows[k] if self.rows else None
            if rows is None:
                self._slot(bufs[i], slot).copy_(part)
            else:
                self._slot(bufs[i], slot)[:, rows] = part
            start += size


__all__ = ["DTYPE_NAMES", "KV_LAYOUTS", "HostKV", "HostState", "LayoutUnsupported", "MHAHostPool", "MambaHostPool"]
