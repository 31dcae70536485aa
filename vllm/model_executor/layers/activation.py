"""Gated activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x = [gate | up] on the last dim -> silu(gate) * up.

    Shapes: x [..., 2 * d] -> [..., d]; the gate half comes first, which is
    the order `MergedColumnParallelLinear([d, d])` stacks gate_proj/up_proj in.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
