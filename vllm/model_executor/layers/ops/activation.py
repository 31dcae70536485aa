"""SiLU-and-mul (SwiGLU's gate) in one Triton launch.

    x = [gate | up]  [T, 2d]   ->   out[t, j] = silu(gate[t, j]) * up[t, j]   [T, d]
    silu(g) = g / (1 + exp(-g))

As `SiluAndMul.forward_native` (vllm/model_executor/layers/activation.py, the
reference): silu is computed in float32 and rounded to the input dtype, then
the product is computed in float32 and rounded again, as torch's two ops do.
Only `exp` differs (Triton's vs torch's), by float32 ulps.

    grid (T, cdiv(d, BLOCK_D)): program (t, j) reads gate[t, j*B : (j+1)*B] and
    the same columns of up, writes out[t, j*B : (j+1)*B]

The grid depends only on the shape, so the launch is CUDA-graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)

# Columns per program: large enough to stream, small enough that d = 14336
# (Llama-3-8B) still spreads over 14 programs when T = 1.
MAX_BLOCK_D = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,  # [num_tokens, 2 * d], last dim contiguous
    out_ptr,  # [num_tokens, d] contiguous
    d,
    stride_x,  # row stride of x, elements
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < d
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + d + offs, mask=mask, other=0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    # div_rn: IEEE division, as torch's `/` (Triton may otherwise divide approximately).
    silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * d + offs, (silu * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """silu(x[:, :d]) * x[:, d:] in one launch.

    Args:
        x: [num_tokens, 2 * d] float16/bfloat16/float32, last dim contiguous,
            any row stride.

    Returns:
        A new contiguous [num_tokens, d] tensor in x's dtype.

    Raises:
        ValueError: not 2-D, an odd last dim, a strided last dim, an unsupported
            dtype or a non-CUDA device (numbers given).
    """
    check_dtype("silu_and_mul", "x", x)
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(
            f"silu_and_mul: x must be [num_tokens, 2 * d] with an even last dim, "
            f"got {tuple(x.shape)}"
        )
    check_last_dim_contiguous("silu_and_mul", x=x)
    check_same_device("silu_and_mul", x=x)
    num_tokens, d = x.shape[0], x.shape[1] // 2
    out = torch.empty(num_tokens, d, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    block_d = min(triton.next_power_of_2(d), MAX_BLOCK_D)
    _silu_and_mul_kernel[(num_tokens, triton.cdiv(d, block_d))](
        x,
        out,
        d,
        x.stride(0),
        BLOCK_D=block_d,
        num_warps=4 if block_d >= 512 else 1,
        enable_fp_fusion=False,
    )
    return out
