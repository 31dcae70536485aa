"""Small-batch projections with their elementwise prologue fused in: one launch each.

For decode batches of a small model every kernel of a layer costs its launch
(a few microseconds under a CUDA graph), not its bytes. Two pairs of launches
become one here:

    rms_norm_linear       y = norm(x [+ residual]) @ W^T [+ b]   (input_layernorm -> qkv_proj,
                                                                 post_attention_layernorm
                                                                 -> gate_up_proj)
    silu_and_mul_linear   y = (silu(gate) * up) @ W^T            (act_fn -> down_proj)

    grid (cdiv(N, BLOCK_N),): program j computes output columns j*BLOCK_N ..
    for ALL rows (M <= MAX_ROWS, padded to M_PAD = 16 for tl.dot):
      rms_norm_linear: pass 1 over K: s = x + residual (rounded to the dtype),
                       sum of squares per row; program 0 also stores s (the
                       new residual stream); pass 2 over K: a = (s * rstd)
                       rounded, times the norm weight, rounded; acc += a @ W_tile^T
      silu_and_mul_linear: one pass over K: a = silu(gate) rounded, times up,
                       rounded; acc += a @ W_tile^T
    acc is float32 (+ bias), rounded once at the store, as cuBLAS does.

Each program re-reads the M x K activations (from L2: 16 x 2048 x 2 bytes at
most) and streams its own BLOCK_N x K slice of W once. The elementwise parts
round where `RMSNorm.forward_native` / `SiluAndMul.forward_native` round, so
the matmul input `a` equals the torch path's bit for bit except for the float32
sum order of the mean square (and `exp` in silu); the products' sum order
differs from cuBLAS', so outputs agree to a bf16/fp16 ulp or two, not bitwise.

Scope (checked by `vllm/model_executor/layers/fused_linear.py`, which decides):
only for M <= MAX_ROWS rows and small weights; bigger GEMMs are bandwidth or
compute bound and cuBLAS does them better. `num_rows` is not specialised on
(every decode batch size shares one compiled variant).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_norm_inputs,
    check_same_device,
    gate_up_width,
)

MAX_ROWS = 16  # = M_PAD: tl.dot's smallest M; larger batches take the unfused path
BLOCK_N = 16  # output columns per program: N = 960 (SmolLM2 qkv) -> 60 programs
BLOCK_K = 256  # SmolLM2: K = 576 in 3 steps, down_proj's K = 1536 in 6


@triton.jit
def _row_chunk(
    x_ptr, res_ptr, offs_m, offs_k, mask, stride_x, stride_r, HAS_RESIDUAL: tl.constexpr
):
    """x[:, chunk] (+ residual[:, chunk], the sum rounded to x's dtype as torch's add)."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_k[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs_m[:, None] * stride_r + offs_k[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
    return x


@triton.jit
def _dot_weight_tile(
    acc, a, w_ptr, offs_n, offs_k, n_mask, k_mask, stride_w, FP32_IEEE: tl.constexpr
):
    """acc [M_PAD, BLOCK_N] fp32 + a [M_PAD, BLOCK_K] @ W[offs_n, offs_k]^T (W is [n_out, K])."""
    w = tl.load(  # [BLOCK_K, BLOCK_N]
        w_ptr + offs_n[None, :].to(tl.int64) * stride_w + offs_k[:, None],
        mask=k_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    if FP32_IEEE:
        acc = tl.dot(a, w, acc=acc, input_precision="ieee")
    else:
        acc = tl.dot(a, w, acc=acc)
    return acc


@triton.jit
def _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, n_out):
    """out[offs_m, offs_n] = acc rounded once to out's dtype (out is [num_rows, n_out])."""
    tl.store(
        out_ptr + offs_m[:, None] * n_out + offs_n[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & n_mask[None, :],
    )


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_linear_kernel(
    x_ptr,  # [num_rows, K], last dim contiguous
    res_ptr,  # [num_rows, K] (HAS_RESIDUAL), last dim contiguous
    norm_w_ptr,  # [K], x's dtype
    w_ptr,  # [n_out, K], last dim contiguous
    bias_ptr,  # [n_out] (HAS_BIAS)
    out_ptr,  # [num_rows, n_out] contiguous
    res_out_ptr,  # [num_rows, K] contiguous (HAS_RESIDUAL): x + residual
    num_rows,
    n_out,
    stride_x,
    stride_r,
    stride_w,
    eps,
    K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < num_rows
    sum_sq = tl.zeros([M_PAD], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask = m_mask[:, None] & (offs_k < K)[None, :]
        x = _row_chunk(x_ptr, res_ptr, offs_m, offs_k, mask, stride_x, stride_r, HAS_RESIDUAL)
        if HAS_RESIDUAL:  # noqa: SIM102 (constexpr branch, then a runtime one)
            if pid == 0:  # program 0 writes the new residual stream
                tl.store(res_out_ptr + offs_m[:, None] * K + offs_k[None, :], x, mask=mask)
        x32 = x.to(tl.float32)
        sum_sq += tl.sum(x32 * x32, axis=1)
    rstd = tl.math.rsqrt(sum_sq / K + eps)

    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = m_mask[:, None] & k_mask[None, :]
        x = _row_chunk(x_ptr, res_ptr, offs_m, offs_k, mask, stride_x, stride_r, HAS_RESIDUAL)
        normed = (x.to(tl.float32) * rstd[:, None]).to(dtype)
        nw = tl.load(norm_w_ptr + offs_k, mask=k_mask, other=0.0)
        a = (normed.to(tl.float32) * nw.to(tl.float32)[None, :]).to(dtype)
        acc = _dot_weight_tile(acc, a, w_ptr, offs_n, offs_k, n_mask, k_mask, stride_w, FP32_IEEE)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, n_out)


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_linear_kernel(
    x_ptr,  # [num_rows, 2 * K] = gate | up, last dim contiguous
    w_ptr,  # [n_out, K], last dim contiguous
    out_ptr,  # [num_rows, n_out] contiguous
    num_rows,
    n_out,
    stride_x,
    stride_w,
    K: tl.constexpr,
    M_PAD: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP32_IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_m = tl.arange(0, M_PAD)
    m_mask = offs_m < num_rows
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        mask = m_mask[:, None] & k_mask[None, :]
        rows = x_ptr + offs_m[:, None] * stride_x + offs_k[None, :]
        gate = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(rows + K, mask=mask, other=0.0).to(tl.float32)
        # As ops/activation.py: silu in float32 (IEEE division), rounded; product rounded.
        silu = tl.math.div_rn(gate, 1.0 + tl.exp(-gate)).to(dtype).to(tl.float32)
        a = (silu * up).to(dtype)
        acc = _dot_weight_tile(acc, a, w_ptr, offs_n, offs_k, n_mask, k_mask, stride_w, FP32_IEEE)
    _store_tile(out_ptr, acc, offs_m, offs_n, m_mask, n_mask, n_out)


def rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(RMSNorm(x + residual) @ weight^T + bias, x + residual) in one launch.

    Args:
        x: [M, K] float16/bfloat16/float32, M <= MAX_ROWS, last dim contiguous.
        residual: None or like x (any row stride).
        norm_weight: [K], x's dtype. eps: added to the mean square.
        weight: [N, K], x's dtype, last dim contiguous. bias: None or [N].

    Returns:
        (y [M, N] contiguous, new residual [M, K] contiguous, or None without a
        residual). Inputs are not modified.

    Raises:
        ValueError: dtypes, shapes, strides, devices, or M > MAX_ROWS.
    """
    num_rows, k, n = _check_rms_norm_linear(x, residual, norm_weight, weight, bias)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    res_out = None
    if residual is not None:
        res_out = torch.empty(num_rows, k, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out, res_out
    _rms_norm_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        x,
        x if residual is None else residual,
        norm_weight,
        weight,
        weight if bias is None else bias,
        out,
        out if res_out is None else res_out,
        num_rows,
        n,
        x.stride(0),
        x.stride(0) if residual is None else residual.stride(0),
        weight.stride(0),
        eps,
        K=k,
        HAS_RESIDUAL=residual is not None,
        HAS_BIAS=bias is not None,
        M_PAD=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FP32_IEEE=x.dtype == torch.float32,
        num_warps=4,
        enable_fp_fusion=False,  # round the norm's products where torch does
    )
    return out, res_out


def silu_and_mul_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """(silu(x[:, :K]) * x[:, K:]) @ weight^T in one launch.

    Args:
        x: [M, 2K] float16/bfloat16/float32, M <= MAX_ROWS, last dim contiguous.
        weight: [N, K], x's dtype, last dim contiguous.

    Returns:
        y [M, N] contiguous in x's dtype.

    Raises:
        ValueError: dtypes, shapes, strides, devices, or M > MAX_ROWS.
    """
    op = "silu_and_mul_linear"
    num_rows, k, n = _check(op, x, weight, gate_up_width(op, x))
    check_last_dim_contiguous(op, x=x, weight=weight)
    check_same_device(op, x=x, weight=weight)
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return out
    _silu_and_mul_linear_kernel[(triton.cdiv(n, BLOCK_N),)](
        x,
        weight,
        out,
        num_rows,
        n,
        x.stride(0),
        weight.stride(0),
        K=k,
        M_PAD=MAX_ROWS,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        FP32_IEEE=x.dtype == torch.float32,
        num_warps=4,
        enable_fp_fusion=False,
    )
    return out


def _check_rms_norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Validate `rms_norm_linear`'s inputs; returns (M, K, N)."""
    op = "rms_norm_linear"
    num_rows, k, n = _check(op, x, weight, x.shape[-1] if x.dim() == 2 else -1)
    check_norm_inputs(op, x, residual, norm_weight, k)
    tensors = dict(x=x, norm_weight=norm_weight, weight=weight)
    if residual is not None:
        tensors["residual"] = residual
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"{op}: bias must be [{n}] {x.dtype}, got {tuple(bias.shape)}")
        tensors["bias"] = bias
    check_last_dim_contiguous(op, **tensors)
    check_same_device(op, **tensors)
    return num_rows, k, n


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, k: int) -> tuple[int, int, int]:
    """Validate x [M, *] and weight [N, k]; returns (M, k, N)."""
    check_dtype(op, "x", x)
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        raise ValueError(f"{op}: x must be [M <= {MAX_ROWS}, features], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != k or weight.dtype != x.dtype or k <= 0:
        raise ValueError(
            f"{op}: weight must be [N, {k}] {x.dtype}, got {weight.dtype} {tuple(weight.shape)}"
        )
    return x.shape[0], k, weight.shape[0]
