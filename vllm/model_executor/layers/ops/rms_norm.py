"""RMSNorm, optionally with the residual add in front, in one Triton launch.

    s        = x + residual                      (input dtype, when a residual is given)
    normed   = (s32 * rsqrt(mean(s32^2) + eps)).to(input dtype)      s32 = s in float32
    out      = normed * weight                   (promoted dtype, as torch's `*`)

The casts are those of `RMSNorm.forward_native` (vllm/model_executor/layers/
layernorm.py, HF's LlamaRMSNorm): every product and sum is computed in float32
and rounded to the dtype torch would round it to, at the same point. Only the
order of the mean's float32 sum differs, so bf16/fp16 outputs equal the torch
path's or differ by one unit in the last place where a float32 rounding of the
statistic tips a value over a rounding boundary.

    rows:  x viewed as [num_outer, num_inner, hidden]; row r = (r // num_inner, r % num_inner)
           2-D [T, hidden]           -> num_inner = 1
           3-D [T, heads, head_dim]  -> per-head norms (Qwen3 q/k norm) on a strided
                                        slice of the qkv projection, no copy

One program normalises one row (the whole row in one tile, so the mean is one
`tl.sum`); the grid is the number of rows, so the launch is CUDA-graph capturable.

The new residual is written to a NEW tensor, not into `residual`: that keeps
`forward_native`'s contract (inputs untouched) and moves the same bytes as an
in-place update (read x and residual, write two rows). Rejected: updating the
residual buffer in place (vLLM's fused_add_rms_norm) would alias the caller's
tensor, e.g. the embedding output the first layer passes in.
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

# One row is held in registers: rows longer than this would spill.
MAX_HIDDEN_SIZE = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [num_outer, num_inner, n_cols], last dim contiguous
    residual_ptr,  # same shape as x, own strides (read only when HAS_RESIDUAL)
    weight_ptr,  # [n_cols] contiguous
    out_ptr,  # [num_outer * num_inner, n_cols] contiguous, promoted dtype
    residual_out_ptr,  # [num_outer * num_inner, n_cols] contiguous, x dtype (HAS_RESIDUAL)
    num_inner,
    stride_x_outer,
    stride_x_inner,
    stride_r_outer,
    stride_r_inner,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,  # next power of two >= n_cols
):
    row = tl.program_id(0).to(tl.int64)
    outer = row // num_inner
    inner = row % num_inner
    offs = tl.arange(0, BLOCK_N)
    mask = offs < n_cols
    x = tl.load(x_ptr + outer * stride_x_outer + inner * stride_x_inner + offs, mask=mask, other=0)
    if HAS_RESIDUAL:
        r = tl.load(
            residual_ptr + outer * stride_r_outer + inner * stride_r_inner + offs,
            mask=mask,
            other=0,
        )
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + row * n_cols + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.math.rsqrt(variance + eps)).to(x_ptr.dtype.element_ty)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0)
    out = normed.to(tl.float32) * weight.to(tl.float32)
    tl.store(out_ptr + row * n_cols + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * norm(x)` over the last dim, one launch.

    Args:
        x: [..., hidden] float16/bfloat16/float32, last dim contiguous; other
            strides free for up to 3 dims (more dims are flattened, which may copy).
        weight: [hidden] contiguous, float16/bfloat16/float32.
        eps: added to the mean square.

    Returns:
        A new contiguous tensor of x's shape in torch.promote_types(weight, x).

    Raises:
        ValueError: dtypes, shapes, strides or devices that do not fit (numbers given).
    """
    out, _ = _launch("rms_norm", x, None, weight, eps)
    return out


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`s = x + residual; (weight * norm(s), s)` in one launch; x and residual untouched.

    Args:
        x, residual: [..., hidden], same shape and dtype, last dims contiguous.
        weight, eps: as in `rms_norm`.

    Returns:
        (normed [x.shape] in the promoted dtype, new residual [x.shape] in x's dtype),
        both new contiguous tensors.

    Raises:
        ValueError: as `rms_norm`, or residual's shape/dtype differs from x's.
    """
    out, residual_out = _launch("fused_add_rms_norm", x, residual, weight, eps)
    return out, residual_out


def _launch(
    op: str,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check_inputs(op, x, residual, weight)
    hidden = x.shape[-1]
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    residual_out = None
    if residual is not None:
        residual_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out, residual_out
    x3 = _rows(x)
    r3 = x3 if residual is None else _rows(residual)
    block_n = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x3.shape[0] * x3.shape[1],)](
        x3,
        r3,
        weight,
        out,
        out if residual_out is None else residual_out,
        x3.shape[1],
        x3.stride(0),
        x3.stride(1),
        r3.stride(0),
        r3.stride(1),
        hidden,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        num_warps=min(max(block_n // 512, 1), 16),
        enable_fp_fusion=False,  # no FMA contraction: round products where torch does
    )
    return out, residual_out


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t as [num_outer, num_inner, hidden] without a copy where the strides allow."""
    if t.dim() == 1:
        return t.view(1, 1, -1)
    if t.dim() == 2:
        return t.unsqueeze(1)
    if t.dim() == 3:
        return t
    return t.flatten(0, -3)


def _check_inputs(
    op: str, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor
) -> None:
    check_dtype(op, "x", x)
    check_dtype(op, "weight", weight)
    if x.dim() == 0:
        raise ValueError(f"{op}: x must have a hidden dim, got a 0-dim tensor")
    hidden = x.shape[-1]
    if not 0 < hidden <= MAX_HIDDEN_SIZE:
        raise ValueError(f"{op}: hidden size must be in [1, {MAX_HIDDEN_SIZE}], got {hidden}")
    if weight.shape != (hidden,) or weight.stride(0) != 1:
        raise ValueError(
            f"{op}: weight must be contiguous [{hidden}], got {tuple(weight.shape)} "
            f"strides {weight.stride()}"
        )
    tensors = {"x": x, "weight": weight}
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(
                f"{op}: residual must match x, got residual {residual.dtype} "
                f"{tuple(residual.shape)} and x {x.dtype} {tuple(x.shape)}"
            )
        tensors["residual"] = residual
    check_last_dim_contiguous(op, **tensors)
    check_same_device(op, **tensors)
