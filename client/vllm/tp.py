"""The worker's tensor-parallel group, as the connector uses it: which rank this is, and one
collective, a gather of each rank's slice of a save to rank 0.

Why a gather: the store's layout names every KV head and state unit of the model (client/heads.py),
so a block's entry is written whole, by one writer. A rank holds only its heads; its slice goes to
rank 0, which writes the entry. Rejected: each rank putting its own heads into the entry and the
store assembling it (a pending entry with several writers, committed when its last head arrived):
that is the store's write path, its offers, quotas and cluster placement made multi-writer, for
what one collective per save does inside the engine, where the ranks already run in lock step.

The collective is called from ``wait_for_save``, which every rank runs after the same forward pass
with the same plans (vLLM broadcasts the scheduler's metadata), so every rank calls it the same
number of times, in the same order, with slices of the same size. A rank that fails to copy its
slice still calls it (with a flag that says so): a rank that skipped it would hang the others.
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

log = logging.getLogger(__name__)


class TpGroup(Protocol):
    """What the worker needs of its tensor-parallel group (a documented seam: tests build two
    workers in one process and join them with their own group)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``local`` (uint8, the same size on every rank) on rank 0, in rank order;
        None on the other ranks."""

    def all_agree(self, ok: bool) -> bool:
        """Whether every rank says ``ok`` (one collective on every rank)."""


class SingleRank:
    """Tensor-parallel size 1: nothing to gather."""

    rank = 0
    size = 1

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        return [local]

    def all_agree(self, ok: bool) -> bool:
        return ok


class VllmTpGroup:
    """vLLM's own tensor-parallel group (``get_tp_group()``): device tensors through its device
    communicator (NCCL on GPUs), host tensors through its CPU (gloo) group."""

    def __init__(self) -> None:
        from vllm.distributed.parallel_state import get_tp_group

        self._group = get_tp_group()

    @property
    def rank(self) -> int:
        return int(self._group.rank_in_group)

    @property
    def size(self) -> int:
        return int(self._group.world_size)

    def gather(self, local: torch.Tensor) -> list[torch.Tensor] | None:
        if local.device.type != "cpu":
            out = self._group.gather(local, dst=0, dim=0)
            return None if out is None else list(out.chunk(self.size))
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=self._group.ranks[0], group=self._group.cpu_group)
        return parts

    def all_agree(self, ok: bool) -> bool:
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._group.cpu_group)
        return bool(flag.item())


def vllm_tp_group(tp_size: int) -> TpGroup:
    """This worker's group: vLLM's where its parallel state is set up, else (one process, no
    distributed setup: a test) a single rank, which a configured tp_size > 1 makes an error."""
    try:
        group: TpGroup = VllmTpGroup()
    except (AssertionError, RuntimeError, ImportError) as err:  # vLLM's "not initialized" assertion
        if tp_size > 1:
            raise ValueError(f"tensor_parallel_size={tp_size} but no tensor-parallel group: {err}") from err
        return SingleRank()
    if group.size != tp_size:
        raise ValueError(f"the tensor-parallel group has {group.size} ranks, the config {tp_size}")
    return group if group.size > 1 else SingleRank()


__all__ = ["SingleRank", "TpGroup", "VllmTpGroup", "vllm_tp_group"]
