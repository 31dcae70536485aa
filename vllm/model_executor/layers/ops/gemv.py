"""Skinny projections (a decode batch of 1..16 rows): y = x W^T (+ b), bandwidth-bound.

A decode step of a large model reads every weight once for a handful of rows,
so a projection's time is its weight bytes over the HBM bandwidth it reaches.
cuBLAS tiles such a GEMM 64 or 128 output columns per CTA; when N / 64 is
under about two waves of the SMs (Llama-3-8B on an H200: qkv N = 6144 -> 96
CTAs for 132 SMs, o_proj 4096 -> 64, split-K 2 plus a reduce kernel) part of
the chip idles and the read runs at ~3.1 TB/s where gate_up (N = 28672)
reaches ~4.2 (`benchmarks/benchmark_gemv.py`). Here the columns are cut
finer, so a launch has enough programs to keep every SM streaming:

    grid (cdiv(N, BLOCK_N),): program j owns output columns [j*BLOCK_N, (j+1)*BLOCK_N)
      for k0 in 0, BLOCK_K, ..:   w = W[cols, k0:k0+BLOCK_K]   (rows of W read along K,
                                                              coalesced, each byte once)
        M_PAD == 1:  acc[BLOCK_N]        += sum_k w * x[k]     (no padding to a tl.dot)
        M_PAD >= 16: acc[M_PAD, BLOCK_N] += x_tile @ w^T        (rows past M are masked)
      y[:, cols] = acc (+ bias), rounded once, as cuBLAS does

Products are summed in float32 in a different order from cuBLAS', so outputs
agree with `F.linear` to a bf16/fp16 ulp or two, not bitwise.
`num_rows` and the row strides are not specialised on (every decode batch shares
one compiled variant per layer shape), so warm-up compiles all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm.model_executor.layers.ops import (
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from vllm.v1.attention.ops.attention_config import num_sms

MAX_ROWS = 16  # tl.dot's smallest M: rows 2..16 share one padded tile


@dataclass(frozen=True)
class GemvConfig:
    """Tile of one launch: output columns and K elements per program step, warps, stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 1


@triton.jit(do_not_specialize=["num_rows", "stride_x", "stride_o"])
def _gemv_kernel(
    x_ptr,  # [num_rows, K], last dim contiguous
    w_ptr,  # [n_out, K], last dim contiguous
    bias_ptr,  # [n_out] (HAS_BIAS)
    out_ptr,  # [num_rows, n_out], last dim contiguous
    num_rows,
    n_out,
    K,
    stride_x,
    stride_w,
    stride_o,
    HAS_BIAS: tl.constexpr,
    M_PAD: tl.constexpr,  # 1 (one row, no dot) or 16 (tl.dot, rows masked)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0: no K masks
    FP32_IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    dtype = out_ptr.dtype.element_ty
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_out
    # Out-of-range columns read row n_out - 1 (in bounds, discarded at the store),
    # so the weight loads need no mask along N.
    w_rows = w_ptr + tl.minimum(offs_n, n_out - 1).to(tl.int64)[:, None] * stride_w
    offs_kb = tl.arange(0, BLOCK_K)
    if M_PAD == 1:
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_kb
            if EVEN_K:
                x = tl.load(x_ptr + offs_k)
                w = tl.load(w_rows + offs_k[None, :])
            else:
                k_mask = offs_k < K
                x = tl.load(x_ptr + offs_k, mask=k_mask, other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs_n, acc.to(dtype), mask=n_mask)
    else:
        offs_m = tl.arange(0, M_PAD)
        m_mask = offs_m < num_rows
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
        acc = tl.zeros([M_PAD, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            offs_k = k0 + offs_kb
            if EVEN_K:
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None], other=0.0)
                w = tl.load(w_rows + offs_k[None, :])
            else:
                k_mask = offs_k < K
                x = tl.load(x_rows + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                            other=0.0)
                w = tl.load(w_rows + offs_k[None, :], mask=k_mask[None, :], other=0.0)
            if FP32_IEEE:
                acc = tl.dot(x, tl.trans(w), acc=acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w), acc=acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        tl.store(
            out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :],
            acc.to(dtype),
            mask=m_mask[:, None] & n_mask[None, :],
        )


def default_config(num_rows: int, n: int, k: int, sm_count: int) -> GemvConfig:
    """The tile `gemv` uses when none is given.

    One row: 8 output columns per program, K in steps of 1024 (the whole row
    when shorter), 8 warps. In the H200 sweep of `benchmarks/benchmark_gemv.py`
    (2026-12-03, docs/benchmarks.md) that was the best tile for Llama-3-8B's
    o_proj and down and for all four SmolLM2-135M projections; qkv's and
    gate_up's best were other tiles (8 x 2048 with 4 warps: 15.41 us; 16 x 512:
    56.74 us), not timed against this one in that run. The engine A/B (8B
    batch-1 step 4.43 ms against 4.67 with cuBLAS) ran with this default.
    More rows (tl.dot; cuBLAS is faster there, so the engine does not use
    them): BLOCK_N 32 (16 when that gives fewer than
    2 * sm_count programs), BLOCK_K 512, the sweep's best for 8 and 16 rows.
    """
    if num_rows == 1:
        return GemvConfig(block_n=8, block_k=min(1024, triton.next_power_of_2(k)), num_warps=8)
    block_n = 32 if triton.cdiv(n, 32) >= 2 * sm_count else 16
    return GemvConfig(block_n=block_n, block_k=min(512, max(16, triton.next_power_of_2(k))),
                      num_warps=4, num_stages=3)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """x @ weight^T + bias for a few rows, as one Triton launch.

    Args:
        x: [M, K] float16/bfloat16/float32, 1 <= M <= MAX_ROWS, last dim contiguous.
        weight: [N, K], x's dtype, last dim contiguous.
        bias: None or [N], x's dtype.
        config: tile override (benchmarks); None picks `default_config`.

    Returns:
        y [M, N] contiguous, x's dtype.

    Raises:
        ValueError: dtypes, shapes, strides, devices, or M outside 1..MAX_ROWS.
    """
    op = "gemv"
    check_dtype(op, "x", x)
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"{op}: x must be [M, K] and weight [N, K], got {tuple(x.shape)} and "
            f"{tuple(weight.shape)}"
        )
    num_rows, k = x.shape
    n = weight.shape[0]
    if not 1 <= num_rows <= MAX_ROWS:
        raise ValueError(f"{op}: takes 1..{MAX_ROWS} rows, got {num_rows}")
    if weight.dtype != x.dtype:
        raise ValueError(f"{op}: weight must be {x.dtype}, got {weight.dtype}")
    tensors = dict(x=x, weight=weight)
    if bias is not None:
        if bias.shape != (n,) or bias.dtype != x.dtype:
            raise ValueError(f"{op}: bias must be [{n}] {x.dtype}, got {bias.dtype} "
                             f"{tuple(bias.shape)}")
        tensors["bias"] = bias
    check_last_dim_contiguous(op, **tensors)
    check_same_device(op, **tensors)
    if config is None:
        config = default_config(num_rows, n, k, num_sms(x.device))
    out = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, config.block_n),)](
        x,
        weight,
        weight if bias is None else bias,
        out,
        num_rows,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        M_PAD=1 if num_rows == 1 else MAX_ROWS,
        BLOCK_N=config.block_n,
        BLOCK_K=config.block_k,
        EVEN_K=k % config.block_k == 0,
        FP32_IEEE=x.dtype == torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out

