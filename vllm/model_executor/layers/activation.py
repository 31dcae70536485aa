"""Gated activations.

On CUDA `SiluAndMul` runs one fused Triton kernel (`ops/activation.py`);
elsewhere, and as the kernel's reference, the torch code in `forward_native`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vllm.model_executor.layers.ops import use_fused_ops


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x = [gate | up] on the last dim -> silu(gate) * up.

    Shapes: x [..., 2 * d] -> [..., d]; the gate half comes first, which is
    the order `MergedColumnParallelLinear([d, d])` stacks gate_proj/up_proj in.
    Returns a new tensor in x's dtype.

    `forward` runs `forward_cuda` (one Triton launch) for CUDA tensors of
    float16/bfloat16/float32 when Triton imports, else `forward_native`.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused_ops(x):
            return self.forward_cuda(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        """The torch path: the CPU implementation and the kernel's reference."""
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        """One Triton launch; same contract as `forward_native`.

        Raises:
            ValueError: an odd last dim.
        """
        from vllm.model_executor.layers.ops.activation import silu_and_mul

        if x.stride(-1) != 1:
            x = x.contiguous()
        out = silu_and_mul(x.flatten(0, -2) if x.dim() > 1 else x.unsqueeze(0))
        return out.view(*x.shape[:-1], out.shape[-1])
