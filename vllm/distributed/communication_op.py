"""The collectives the model layers call, over this rank's tensor-parallel group."""

from __future__ import annotations

import torch

from vllm.distributed.parallel_state import get_tp_group


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum `x` over the tensor-parallel ranks (in place; returns `x`)."""
    return get_tp_group().all_reduce(x)


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every tensor-parallel rank's `x` along `dim`, in rank order."""
    return get_tp_group().all_gather(x, dim)
