"""Which heads a tensor-parallel rank holds, and the canonical state layout (client/heads.py).

The checks shard whole tensors the way the engines do (each head group of a tensor split over the
ranks on its own: vLLM's ``mamba_v2_sharded_weight_loader``, SGLang's ``conv_shard_groups``), then
map each rank's local rows to the canonical ones; the canonical tensor is built here by hand, by
unit, independently of the module."""

from __future__ import annotations

import numpy as np
import pytest

from prefixstore.client.heads import (
    HeadGroup,
    StateShards,
    StateTensor,
    gated_delta_net_shards,
    head_owners,
    kv_heads,
    uniform_shards,
)


@pytest.mark.parametrize(("tp", "heads", "want"), [
    (1, 8, [(0, 8)]),
    (2, 8, [(0, 4), (4, 8)]),
    (4, 8, [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (4, 2, [(0, 1), (0, 1), (1, 2), (1, 2)]),  # fewer heads than ranks: replicated, as vLLM's QKV does
])
def test_kv_heads_of_each_rank(tp: int, heads: int, want: list[tuple[int, int]]) -> None:
    assert [kv_heads(r, tp, heads) for r in range(tp)] == want


def test_replicated_heads_have_one_owner() -> None:
    assert head_owners(4, 2) == [1, 0, 1, 0] and head_owners(2, 8) == [1, 1]


@pytest.mark.parametrize(("tp", "heads"), [(3, 8), (4, 3)])
def test_heads_that_do_not_split_are_refused(tp: int, heads: int) -> None:
    with pytest.raises(ValueError):
        kv_heads(0, tp, heads)


def shard_rows(full: np.ndarray, groups: list[tuple[int, int]], rank: int, tp: int) -> np.ndarray:
    """A rank's local tensor as the engines shard it: each group's heads split on their own."""
    parts, start = [], 0
    for heads, rows in groups:
        per = heads // tp * rows
        parts.append(full[start + rank * per : start + (rank + 1) * per])
        start += heads * rows
    return np.concatenate(parts)


def canonical_by_hand(full: np.ndarray, groups: list[tuple[int, int]], units: int) -> np.ndarray:
    """The canonical tensor: per unit, each group's heads of that unit, in group order."""
    out = []
    for u in range(units):
        start = 0
        for heads, rows in groups:
            per = heads // units * rows
            out.append(full[start + u * per : start + (u + 1) * per])
            start += heads * rows
    return np.concatenate(out)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_gated_delta_net_conv_rows_by_unit(tp: int) -> None:
    """GDN's conv state is cat(q, k, v) channels, each split by heads on its own: rank r's rows,
    mapped to the canonical order, are units [r*U/t, (r+1)*U/t) of the canonical tensor, and the
    ranks' slices side by side are the whole of it."""
    nk, nv, dk, dv, width = 4, 8, 3, 2, 4
    shards = gated_delta_net_shards(num_k_heads=nk, num_v_heads=nv, head_k_dim=dk, head_v_dim=dv, conv_width=width,
                                    conv_dtype="bfloat16", state_dtype="float32")
    groups = [(nk, dk), (nk, dk), (nv, dv)]
    full = np.arange((2 * nk * dk + nv * dv) * (width - 1)).reshape(-1, width - 1)
    canonical = canonical_by_hand(full, groups, shards.units)
    per_unit = len(canonical) // shards.units
    slices = []
    for rank in range(tp):
        local = shard_rows(full, groups, rank, tp)
        mapped = local[shards.canonical_rows(0, tp)]
        units = shards.units // tp
        assert np.array_equal(mapped, canonical[rank * units * per_unit : (rank + 1) * units * per_unit])
        slices.append(mapped)
    assert np.array_equal(np.concatenate(slices), canonical)
    layout = shards.layout(num_layers=3)
    assert layout.num_heads == nk and layout.shapes == ((nk, 2 * dk + 2 * dv, width - 1), (nk, 2, dv, dk))
    assert layout.tensor_dtypes == ("bfloat16", "float32")


def test_a_single_group_maps_rows_to_themselves() -> None:
    """LFM2's short conv (channels split as one block): local order is canonical order."""
    shards = uniform_shards(8, [((8, 2), "float32")])
    for tp in (1, 2, 4):
        assert np.array_equal(shards.canonical_rows(0, tp), np.arange(8 // tp))


def test_units_must_split_over_the_ranks() -> None:
    shards = StateShards(units=2, tensors=(StateTensor(groups=(HeadGroup(num_heads=2, rows_per_head=1),),
                                                       rest=(4,), dtype="float32"),))
    with pytest.raises(ValueError, match="do not split over 4 ranks"):
        shards.canonical_rows(0, 4)
    with pytest.raises(ValueError, match="do not split over 2 units"):
        StateShards(units=2, tensors=(StateTensor(groups=(HeadGroup(num_heads=3, rows_per_head=1),), rest=(),
                                                  dtype="float32"),))
