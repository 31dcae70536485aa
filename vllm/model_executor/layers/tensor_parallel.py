"""Tensor-parallel arithmetic and the two collectives the parallel layers need.

A layer of global size `n` split over `tp_size` ranks keeps the contiguous
slice `[tp_rank * n / tp_size, (tp_rank + 1) * n / tp_size)` on each rank:

    global rows:  | rank 0 | rank 1 | ... | rank tp_size-1 |
                    <-- n // tp_size each -->

Attention heads are the one exception (`partition_attention_heads`, in
vllm/distributed/utils.py with the rest of the split arithmetic): they
split by key/value head, as evenly as the count allows, so a model whose
head count the TP size does not divide (SmolLM2-135M: 9 query and 3 KV heads
at TP=2) still runs, with ranks holding 6 and 3 query heads.

The collectives run over this rank's tensor-parallel group
(`vllm.distributed.get_tp_group()`), which the worker creates before it
builds the model; with tp_size == 1 no collective runs and no group is needed.
"""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import GroupCoordinator, get_tp_group
from vllm.distributed.utils import HeadShard, check_tp, divide, partition_attention_heads

__all__ = [
    "HeadShard",
    "all_gather",
    "all_reduce",
    "check_tp",
    "divide",
    "partition_attention_heads",
]


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the TP ranks in place (identity when tp_size == 1)."""
    if tp_size == 1:
        return x
    return _tp_group(tp_size).all_reduce(x)


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank order (identity when tp_size == 1)."""
    if tp_size == 1:
        return x
    return _tp_group(tp_size).all_gather(x, dim)


def _tp_group(tp_size: int) -> GroupCoordinator:
    group = get_tp_group()
    if group.world_size != tp_size:
        raise RuntimeError(
            f"the tensor-parallel group has {group.world_size} ranks, the layer expects {tp_size}"
        )
    return group
