"""Which heads of the canonical layout a tensor-parallel rank holds, and how its state maps there.

The store's layout names the model's heads, never a rank's share (protocol/namespace.py, hash
scheme 2): a KV payload is ``[layer][K|V][head][token][dim]`` over all KV heads, a snapshot is
``[layer][tensor][unit][...]`` over all state head units. An engine at tensor-parallel size t
reads and writes exactly its rank's heads; this module says which those are, in one place for
every engine adapter (client/vllm, client/sglang).

KV heads: rank r of t holds heads [r*H/t, (r+1)*H/t); when H < t, heads are replicated and rank r
holds head ``r * H // t`` (vLLM's and SGLang's QKV projections).

State: a linear layer's state tensors shard along their first dimension, but not as one block:
GDN's conv state is ``cat(q, k, v)`` channels, each sharded by heads *independently*, so rank r
holds rows ``[q_r | k_r | v_r]``, not a contiguous range of the full tensor. A tensor is therefore
described as :class:`HeadGroup` s (heads, rows per head) laid side by side, and the canonical
tensor is regrouped by *unit* (U units; every group's heads split evenly over them)::

    engine, rank r of 2:   [ q heads 2-3 | k heads 2-3 | v heads 4-7 ]        (GDN: 4 k, 8 v heads)
    canonical, units 2-3:  [ u2: q2 k2 v4 v5 | u3: q3 k3 v6 v7 ]

so rank r's rows are units [r*U/t, (r+1)*U/t) of every tensor: one byte run per layer and
tensor, whatever TP size wrote the snapshot. Numpy only: no engine, no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..protocol.namespace import StateLayout


def kv_heads(rank: int, tp_size: int, num_heads: int) -> tuple[int, int]:
    """The canonical KV heads [start, end) rank ``rank`` of ``tp_size`` holds."""
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank {rank} is not in [0, {tp_size})")
    if num_heads >= tp_size:
        if num_heads % tp_size:
            raise ValueError(f"{num_heads} KV heads do not split over {tp_size} ranks")
        per = num_heads // tp_size
        return rank * per, (rank + 1) * per
    if tp_size % num_heads:
        raise ValueError(f"{num_heads} KV heads do not replicate evenly over {tp_size} ranks")
    head = rank * num_heads // tp_size
    return head, head + 1


def head_owners(tp_size: int, num_heads: int) -> list[int]:
    """For each rank, whether it is the first holder of its heads (replicated heads are written
    once): the ranks whose slices, in rank order, make every head once."""
    seen: set[tuple[int, int]] = set()
    out = []
    for rank in range(tp_size):
        heads = kv_heads(rank, tp_size, num_heads)
        out.append(int(heads not in seen))
        seen.add(heads)
    return out


@dataclass(frozen=True, kw_only=True)
class HeadGroup:
    """Consecutive rows of a state tensor that shard by heads: ``num_heads`` model-wide heads of
    ``rows_per_head`` rows each (channels of a conv state; 1 for a recurrent state's heads)."""

    num_heads: int
    rows_per_head: int


@dataclass(frozen=True, kw_only=True)
class StateTensor:
    """One state tensor of a linear layer: its row groups, the dimensions after the rows (the
    conv window, a head's [d_v, d_k] state), and its dtype."""

    groups: tuple[HeadGroup, ...]
    rest: tuple[int, ...]
    dtype: str

    def local_rows(self, tp_size: int) -> int:
        return sum(g.num_heads // tp_size * g.rows_per_head for g in self.groups)


@dataclass(frozen=True, kw_only=True)
class StateShards:
    """How a linear layer's state splits over ranks, and the canonical layout it names."""

    units: int
    """U: state head units. Every group's heads split evenly over them, and U over the ranks."""
    tensors: tuple[StateTensor, ...]

    def __post_init__(self) -> None:
        if self.units < 1 or not self.tensors:
            raise ValueError("state shards: at least one unit and one tensor")
        for t in self.tensors:
            for g in t.groups:
                if g.num_heads % self.units:
                    raise ValueError(f"state shards: {g.num_heads} heads do not split over {self.units} units")

    def check(self, tp_size: int) -> None:
        """ValueError unless every rank holds whole units at ``tp_size``."""
        if self.units % tp_size:
            raise ValueError(f"{self.units} state head units do not split over {tp_size} ranks")

    def layout(self, num_layers: int) -> StateLayout:
        """The canonical StateLayout: tensor k is ``[U, rows per unit, *rest]``, addressable per unit."""
        shapes = tuple((self.units, sum(g.num_heads // self.units * g.rows_per_head for g in t.groups), *t.rest)
                       for t in self.tensors)
        return StateLayout(num_layers=num_layers, shapes=shapes, num_heads=self.units,
                           dtypes=tuple(t.dtype for t in self.tensors))

    def canonical_rows(self, index: int, tp_size: int) -> np.ndarray:
        """For tensor ``index`` as one rank of ``tp_size`` holds it (its groups' heads side by
        side), the local row of each canonical row of that rank's units, in canonical order:
        ``canonical = local[rows]`` and ``local[rows] = canonical`` (the same for every rank)."""
        self.check(tp_size)
        t = self.tensors[index]
        starts = np.cumsum([0] + [g.num_heads // tp_size * g.rows_per_head for g in t.groups])[:-1]
        out: list[np.ndarray] = []
        for unit in range(self.units // tp_size):
            for g, start in zip(t.groups, starts):
                per = g.num_heads // self.units * g.rows_per_head
                out.append(np.arange(start + unit * per, start + (unit + 1) * per))
        return np.concatenate(out)

    def unit_bytes(self) -> tuple[int, ...]:
        """Bytes of one unit of each tensor."""
        layout = self.layout(1)
        return tuple(b // self.units for b in layout.tensor_bytes)


def uniform_shards(units: int, tensors: list[tuple[tuple[int, ...], str]]) -> StateShards:
    """Tensors that shard as one block along their first dimension (a short conv's channels, a
    Mamba1 or linear-attention state's heads): each ``(model-wide shape, dtype)``."""
    return StateShards(units=units, tensors=tuple(
        StateTensor(groups=(HeadGroup(num_heads=units, rows_per_head=shape[0] // units),), rest=tuple(shape[1:]),
                    dtype=dtype) for shape, dtype in tensors))


def gated_delta_net_shards(*, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int,
                           conv_width: int, conv_dtype: str, state_dtype: str) -> StateShards:
    """A gated-delta-net layer (Qwen3-Next): conv state ``cat(q, k, v)`` channels x (width - 1),
    recurrent state ``[v heads, d_v, d_k]``; one unit per key head (its value heads with it)."""
    conv = StateTensor(groups=(HeadGroup(num_heads=num_k_heads, rows_per_head=head_k_dim),
                               HeadGroup(num_heads=num_k_heads, rows_per_head=head_k_dim),
                               HeadGroup(num_heads=num_v_heads, rows_per_head=head_v_dim)),
                       rest=(conv_width - 1,), dtype=conv_dtype)
    state = StateTensor(groups=(HeadGroup(num_heads=num_v_heads, rows_per_head=1),),
                        rest=(head_v_dim, head_k_dim), dtype=state_dtype)
    return StateShards(units=math.gcd(num_k_heads, num_v_heads), tensors=(conv, state))


__all__ = ["HeadGroup", "StateShards", "StateTensor", "gated_delta_net_shards", "head_owners", "kv_heads",
           "uniform_shards"]
