"""Tensor-parallel arithmetic and the two collectives the parallel layers need.

A layer of global size `n` split over `tp_size` ranks keeps the contiguous
slice `[tp_rank * n / tp_size, (tp_rank + 1) * n / tp_size)` on each rank:

    global rows:  | rank 0 | rank 1 | ... | rank tp_size-1 |
                    <-- n // tp_size each -->

The collectives run over torch.distributed's default process group, which
must then contain exactly the `tp_size` ranks of this model's tensor-parallel
group. When `vllm/distributed` provides a dedicated TP group, `all_reduce` and
`all_gather` are the only two places to point at it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def divide(numerator: int, denominator: int, what: str) -> int:
    """`numerator / denominator`, which must be whole.

    Raises:
        ValueError: naming `what` when `denominator` does not divide `numerator`.
    """
    if denominator <= 0 or numerator % denominator:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by the tensor-parallel size ({denominator})"
        )
    return numerator // denominator


def check_tp(tp_rank: int, tp_size: int) -> None:
    """Raise ValueError unless 0 <= tp_rank < tp_size."""
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank ({tp_rank}) must be in [0, tp_size={tp_size})")


def all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum `x` over the TP ranks in place (identity when tp_size == 1)."""
    if tp_size == 1:
        return x
    _check_group(tp_size)
    dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, tp_size: int, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, rank order (identity when tp_size == 1)."""
    if tp_size == 1:
        return x
    _check_group(tp_size)
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def _check_group(tp_size: int) -> None:
    if not dist.is_initialized():
        raise RuntimeError(
            f"tp_size={tp_size} needs torch.distributed initialized (default group = the TP group)"
        )
    world = dist.get_world_size()
    if world != tp_size:
        raise RuntimeError(f"default process group has {world} ranks, tp_size is {tp_size}")
