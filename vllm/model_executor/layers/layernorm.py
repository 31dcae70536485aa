"""RMSNorm, with the residual add fused in front of it.

    y = weight * (x / sqrt(mean(x^2) + eps))          (Zhang & Sennrich 2019)

The statistics are computed in float32 and the normalised value is cast back
to the input dtype before the weight multiply, as `transformers` does, so
bf16/fp16 models match it rounding for rounding.

On CUDA the layer runs one fused Triton kernel (`ops/rms_norm.py`: residual
add, statistics, scale in one launch); elsewhere, and as the reference the
kernel is tested against, the torch code in `forward_native`.
"""

from __future__ import annotations

import torch
from torch import nn

from vllm.model_executor.layers.ops import use_fused_ops
from vllm.model_executor.layers.weight_utils import default_weight_loader


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension.

    Args:
        hidden_size: size of the normalised (last) dimension.
        eps: added to the mean square before the square root.

    `forward(x)` returns the normalised `x`; `forward(x, residual)` first adds
    the residual, `x = x + residual`, and returns `(norm(x), x)`: the second
    value is the new residual stream. Shapes: [..., hidden_size], any float
    dtype; the weight has the dtype the module was built with; the output has
    torch.promote_types(weight dtype, x dtype). Inputs are never modified:
    both returned tensors are new.

    `forward` runs `forward_cuda` (one Triton launch) for CUDA tensors of
    float16/bfloat16/float32 when Triton imports, else `forward_native`.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x32 = x.float()
        variance = x32.pow(2).mean(-1, keepdim=True)
        return self.weight * (x32 * torch.rsqrt(variance + self.variance_epsilon)).to(input_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if use_fused_ops(x):
            return self.forward_cuda(x, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The torch path: the CPU implementation and the kernel's reference."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One Triton launch; same contract as `forward_native`.

        Raises:
            ValueError: residual's shape or dtype differs from x's (the torch
                path would broadcast or promote; the models never need that).
        """
        from vllm.model_executor.layers.ops.rms_norm import fused_add_rms_norm, rms_norm

        if x.stride(-1) != 1:
            x = x.contiguous()
        if residual is None:
            return rms_norm(x, self.weight, self.variance_epsilon)
        if residual.stride(-1) != 1:
            residual = residual.contiguous()
        return fused_add_rms_norm(x, residual, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"hidden_size={self.hidden_size}, eps={self.variance_epsilon}"
