"""Structured outputs' token bitmask applied to logits (xgrammar's kernels)."""

from __future__ import annotations

import torch


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of the tokens `bitmask` refuses to -inf, in place.

    xgrammar's `apply_token_bitmask_inplace` picks its CUDA (or Triton) kernel for
    device tensors and a C++ loop on the CPU.

    Args:
        logits: [N, V] float32 (float16 / bfloat16 also work).
        bitmask: [N, ceil(V / 32)] int32 on the logits' device; bit j of row i set =
            token j allowed for row i.

    Raises:
        ValueError: the shapes disagree.
    """
    if bitmask.shape != (logits.shape[0], -(-logits.shape[1] // 32)):
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not fit logits "
                         f"{tuple(logits.shape)}: it needs [N, ceil(V / 32)]")
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
